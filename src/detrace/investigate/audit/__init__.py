"""`detrace audit`: every determinism hazard one run of CMD shows, each with its place and its fix.

- `records`: the hazard record and the `detrace.audit/1` report;
- `catalog`: the ATen ops whose result depends on scheduling (data: one record per op, extensible);
- `kernels`: the scanner of Inductor's generated source (C++ and Triton atomics);
- `seeding`: whether a process seeds the global RNGs it draws from;
- `probe`: what runs inside CMD's processes (armed by `detrace audit` through the tracer's injection);
- `judge`: the settings, communication, parallelism and data hazards judged from live objects.
"""
