"""`python -m spectrain_workloads.target`: the same as `spectrain-target`."""

from spectrain_workloads.target.entry import main

main()
