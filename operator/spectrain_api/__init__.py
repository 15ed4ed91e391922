"""The SpecTrainJob API the operator and the workloads share, importable without torch or the
workloads: `names` (every name on the seam), `config` (the typed job config), `rules` (check_spec),
`volumes` (the file:// / pvc:// parser), `rundir` (the run dir's drafter paths), `verdict` (the
SingleContainer supervisor's verdict), `errors`, `exitcodes` and `fsio` (the one atomic write). The
operator image ships this package and the operator only."""
