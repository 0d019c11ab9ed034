"""Ahead-of-time compile checks for Triton kernels, without a GPU.

`compile_report(kernel, signature, constexprs, arch=70)` builds PTX and a cubin for the given
architecture (triton.compile with an explicit GPUTarget) and runs the bundled ptxas once more
with `-v` to read registers and spills. Tests use it so a kernel that cannot build for V100
(sm_70), spills past its budget, uses too much shared memory, or emits Ampere/Hopper-only
instructions fails CI on a CPU machine. Benchmarks record the same report next to timings.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

# PTX instructions that do not exist on sm_70: async copies (sm_80), warpgroup MMA and TMA
# (sm_90), bf16 MMA shapes and packed bf16 arithmetic (sm_80).
_NOT_ON_SM70 = ("cp.async", "wgmma", "cp.async.bulk", "mma.sync.aligned.m16n8k16", ".bf16x2", "ldmatrix")
V100_SHARED_LIMIT = 96 * 1024


@dataclass(frozen=True)
class CompileReport:
    arch: int
    shared_bytes: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    num_warps: int
    forbidden: tuple[str, ...]  # instructions found that the target architecture lacks (sm_70 only)

    def check(self, max_spill_bytes: int = 0, shared_limit: int = V100_SHARED_LIMIT) -> None:
        """Raise AssertionError naming every budget this build breaks."""
        problems = []
        if self.shared_bytes > shared_limit:
            problems.append(f"shared memory {self.shared_bytes} B > {shared_limit} B")
        if self.spill_store_bytes > max_spill_bytes:
            problems.append(f"register spills {self.spill_store_bytes} B > budget {max_spill_bytes} B")
        if self.forbidden:
            problems.append(f"instructions not available on sm_{self.arch}: {list(self.forbidden)}")
        assert not problems, f"sm_{self.arch} build: " + "; ".join(problems)


def _ptxas(arch: int) -> tuple[str, str]:
    """The assembler Triton itself uses for sm_<arch> and the target name it expects.

    Recent Triton emits `.target sm_90a` PTX for Hopper and assembles it with its newest
    ptxas; older versions have no `get_ptxas` and ship one `ptxas`.
    """
    import triton

    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path, target
    except (ImportError, AttributeError, TypeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"), target


def build(kernel, signature: dict[str, str], constexprs: dict[str, object] | None = None, arch: int = 70,
          num_warps: int = 4, num_stages: int = 2, aligned: tuple[str, ...] = ()):
    """The triton.compile result of `kernel` for sm_<arch> (arguments as `compile_report`); .asm holds ptx, cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # under TRITON_INTERPRET=1 kernels are InterpretedFunctions
        kernel = JITFunction(kernel.fn)
    # a parameter left out of the signature takes its default, as a launch that does not pass it does (a None
    # pointer, e.g. the split-K counters of a kernel built without FIXUP, is a constexpr there too)
    constexprs = dict(constexprs or {})
    for p in kernel.params:
        if p.name not in signature and p.has_default:
            constexprs.setdefault(p.name, p.default)
    signature = {p.name: signature.get(p.name, "constexpr") for p in kernel.params
                 if p.name in signature or p.has_default}  # the kernel's order
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def inner_loop_sass(cubin: bytes, marks: tuple[str, ...] = ("HMMA", "HGMMA", "FFMA")) -> list[str]:
    """The SASS opcodes of the innermost multiply loop of a one-kernel cubin: the shortest span [target, branch] of
    a backward BRA that holds one of `marks` (the steady-state body of a software-pipelined K loop), read with the
    bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    code = []  # (address, opcode, branch target or None)
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", text):
        target = re.search(r"`?\(?\.?L?_?x?_?(0x[0-9a-f]+)\)?", m.group(4)) if m.group(3).startswith("BRA") else None
        code.append((int(m.group(1), 16), m.group(3), int(target.group(1), 16) if target else None))
    loops = sorted((a - t, t, a) for a, op, t in code if t is not None and t < a)  # not the trailing `BRA .`
    for _, lo, hi in loops:
        ops = [op for a, op, _ in code if lo <= a <= hi]
        if any(op.startswith(marks) for op in ops):
            return ops
    return []


def inner_loop_ptx(ptx: str, marks: tuple[str, ...] = ("mma", "fma.rn.f32")) -> list[str]:
    """The PTX opcodes of the innermost multiply loop: the shortest span from a label to a later branch back to it
    that holds one of `marks` (for archs whose SASS the bundled tools no longer disassemble: CUDA 13 dropped
    sm_70)."""
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if re.fullmatch(r"\$L__BB\w+:", ln)}
    spans = [(i - labels[m.group(1)], labels[m.group(1)], i) for i, ln in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\w+);", ln)) and labels.get(m.group(1), i) < i]
    for _, lo, hi in sorted(spans):
        ops = [re.sub(r"^@!?%p\d+\s+", "", ln).split()[0] for ln in lines[lo + 1:hi + 1] if ln]
        ops = [op for op in ops if not op.startswith(("$L", ".", "}", "{"))]
        if any(op.startswith(marks) for op in ops):
            return ops
    return []


def compile_report(kernel, signature: dict[str, str], constexprs: dict[str, object] | None = None, arch: int = 70,
                   num_warps: int = 4, num_stages: int = 2, aligned: tuple[str, ...] = ()) -> CompileReport:
    """Compile `kernel` (a @triton.jit function) for sm_<arch> and report resources.

    signature: argument name -> Triton type ("*fp16", "i32", "fp32", "constexpr", ...).
    aligned: arguments to compile as the launcher specialises them at run time when they are
    multiples of 16 (16-byte-aligned pointers, strides and sizes divisible by 16). Without it a build
    assumes nothing, so loads may not vectorise and tl.dot's loads may not pipeline as they do on the GPU.
    """
    compiled = build(kernel, signature, constexprs, arch, num_warps, num_stages, aligned)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        ptxas, target = _ptxas(arch)
        if f".target {target}" not in ptx:
            target = f"sm_{arch}"
        out = subprocess.run([ptxas, "-v", f"--gpu-name={target}", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    info = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    forbidden = tuple(i for i in _NOT_ON_SM70 if i in ptx) if arch < 80 else ()
    return CompileReport(
        arch=arch,
        shared_bytes=int(compiled.metadata.shared),
        registers=int(regs.group(1)) if regs else -1,
        spill_store_bytes=int(spills.group(1)) if spills else 0,
        spill_load_bytes=int(spills.group(2)) if spills else 0,
        num_warps=num_warps,
        forbidden=forbidden,
    )
