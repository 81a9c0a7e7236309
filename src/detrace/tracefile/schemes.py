"""The names of detrace's fingerprint schemes, apart from their definitions (`detrace.digest.scheme`): the trace and
manifest formats name the scheme of their digests, and their readers run in processes that never import torch
(the `detrace.digest` package does). Here, with the trace format, whose package needs no torch either."""

SCHEME = "detrace-fp1"
SCHEME2 = "detrace-fp2"
SCHEMES = (SCHEME, SCHEME2)
