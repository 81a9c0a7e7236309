"""`python -m detrace.examples.train`: the reference trainer under its old name (one release); see
`detrace.workload.train`."""

from detrace._exit import leave
from detrace.workload.train import main

if __name__ == "__main__":
    leave(main())
