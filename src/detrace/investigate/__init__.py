"""The commands that run CMD and judge it: check and check-resume (verify), check-topology, locate,
replay, validate; each command's logic in a module named after it."""
