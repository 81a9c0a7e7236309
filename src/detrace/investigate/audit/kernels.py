"""The scanner of Inductor's generated source: which kernels of an output code module combine values with
atomics, and the ATen ops each was lowered from.

Inductor writes one Python module per compiled graph; each kernel is defined in it as a string of source:
`cpp_fused_... = async_compile.cpp_pybinding([...], r'''<C++>''')` or
`triton_poi_fused_... = async_compile.triton('triton_poi_fused_...', '''<Triton>''', ...)`. A kernel that adds
into memory other threads or programs also add into (`atomic_add`/`atomic_add_vec` in C++, `tl.atomic_add` and
the other `tl.atomic_*` in Triton) gives a result that depends on their order. A reduction kernel (`triton_red_`,
`triton_per_`) with atomics is a split reduction that combines its partial sums with atomic adds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from detrace.record.rungs.compiled import aten_ops

_DEFINITION = re.compile(
    r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\((?:\[[^\]]*\]|'\w+'),\s*r?'''(.*?)'''", re.M | re.S)
_CPP_ATOMIC = re.compile(r"\b(atomic_add(?:_vec)?|atomic_fetch_add|atomic_max|atomic_min)\b")
_TRITON_ATOMIC = re.compile(r"\btl\.(atomic_\w+)\b")


@dataclass(frozen=True, kw_only=True)
class KernelScan:
    """One kernel of an output code module that combines values with atomics."""

    name: str
    """The kernel's name in the output code (`cpp_fused_index_put_new_zeros_0`)."""
    backend: str
    """cpp or triton."""
    atomics: tuple[str, ...]
    """The atomic operations it uses, sorted (`atomic_add`, `tl.atomic_add`, ...)."""
    aten: tuple[str, ...]
    """The ATen ops it was lowered from (read from its name, as the compiled rung names kernels)."""
    split_reduction: bool
    """A reduction kernel combining its partial results with atomics."""

    def __post_init__(self) -> None:
        if self.backend not in ("cpp", "triton") or not self.atomics:
            raise ValueError(f"kernel {self.name!r}: a {self.backend!r} kernel with atomics {self.atomics!r}")

    @property
    def device(self) -> str:
        """The device type it runs on: C++ kernels on the CPU; Triton kernels on the GPU (Inductor's CPU
        Triton backend is experimental and unsupported here)."""
        return "cpu" if self.backend == "cpp" else "cuda"


def scan(source: str) -> list[KernelScan]:
    """The kernels of one output code module's source that use atomics, in the order they are defined."""
    found = []
    for match in _DEFINITION.finditer(source):
        name, how, body = match.groups()
        backend = "triton" if how == "triton" else "cpp"
        pattern = _TRITON_ATOMIC if backend == "triton" else _CPP_ATOMIC
        atomics = sorted({("tl." if backend == "triton" else "") + m.group(1) for m in pattern.finditer(body)})
        if not atomics:
            continue
        found.append(KernelScan(name=name, backend=backend, atomics=tuple(atomics), aten=tuple(aten_ops(name)),
                                split_reduction=name.startswith(("triton_red_", "triton_per_"))))
    return found
