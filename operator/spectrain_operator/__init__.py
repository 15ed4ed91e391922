"""spectrain operator: the SpecTrainJob CRD's controller (kopf), its pure builders, the offline
validator and the `spectrain` CLI. Imports without torch."""

__version__ = "0.1.0"
