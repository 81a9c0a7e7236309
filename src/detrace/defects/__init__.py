"""Defect detection: the replica guard, recheck (transient vs persistent faults), and injected faults."""
