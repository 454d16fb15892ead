"""Every Triton launch the library makes compiles for Hopper (sm_90), checked without a GPU.

The other kernel tests run in Triton's interpreter, which accepts some programs the compiler
rejects; this runs hopper_compile.py (the compiler, LLVM and ptxas on the CPU) in a process
without TRITON_INTERPRET."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..checkout import subprocess_env

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA backend")


def test_every_launch_compiles_for_sm90(tmp_path):
    env = subprocess_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path))  # compile afresh, never from a cache
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"with Triton {triton.__version__}, 0 failed" in done.stdout and "'stride_c': 1, 'SCALE_RULE': 2" in done.stdout
    assert "_fp4_pair_kernel {'RULE_R': 0, 'RULE_C': 0, 'BLOCK': 16" in done.stdout  # a linear's two copies
    # launches as Triton specializes them: one group's G = 1 compiled as a constexpr, in the per-expert
    # amax and in the rows quantize (the two launches Triton 3.6 failed to compile with a search in them)
    lines = done.stdout.splitlines()
    assert any(line.startswith("ok") and "_grouped_amax_kernel {'n_groups': 1," in line for line in lines)
    assert any(line.startswith("ok") and "_fp4_quantize_kernel" in line and "'n_groups': 1," in line
               and "'GROUPED': 1," in line for line in lines)


_ONE_GROUP = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp4lab.kernels.elements import group_of

@triton.jit
def probe(index_ptr, start_ptr, out_ptr, n_groups):
    offs = tl.arange(0, 64)
    tl.store(out_ptr + offs, group_of(tl.load(index_ptr + offs), start_ptr, n_groups))

signature = {"index_ptr": "*i64", "start_ptr": "*i64", "out_ptr": "*i32", "n_groups": "constexpr"}
for n_groups in (1, 2):
    source = ASTSource(probe, signature, {(3,): n_groups})
    ttir = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
    print(n_groups, "scf.while" in ttir, ttir.count("tt.load"))
"""


def test_one_group_compiles_no_search(tmp_path):
    """group_of with G = 1 (as Triton specializes it: a constexpr) compiles to no search at all, on
    any Triton version: the search's loops over a masked vector load, with G = 1, crashed Triton
    3.6's coalescing pass (3.9 compiles them), so they must not be there for a one-expert launch."""
    script = tmp_path / "one_group.py"  # (a @triton.jit function must live in a file)
    script.write_text(_ONE_GROUP)
    done = subprocess.run([sys.executable, str(script)], env=subprocess_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (line.split() for line in done.stdout.splitlines()[:2])
    assert one[:2] == ["1", "False"], done.stdout  # (G = 1: group 0 for every index, nothing loaded)
    assert two[:2] == ["2", "True"] and int(two[2]) > 1, done.stdout  # (the search, where there is one)


@pytest.mark.skipif(not os.environ.get("FP4LAB_DEVICE_TRITON"),
                    reason="FP4LAB_DEVICE_TRITON names no folder holding the GPU machine's Triton (.ci/run installs it)")
def test_every_launch_compiles_for_sm90_on_the_gpu_machines_triton(tmp_path):
    """The same compile with the Triton the lent H100s run (another version than this machine's, whose
    compiler accepted a one-expert launch that the device's rejected): the folder FP4LAB_DEVICE_TRITON
    names, a ``pip install --target`` of that wheel, first on the path."""
    folder = Path(os.environ["FP4LAB_DEVICE_TRITON"])
    found = sorted(p.name for p in folder.glob("triton-*.dist-info"))
    assert len(found) == 1, (f"{folder} must hold one Triton (a pip install --target of one wheel), found "
                             f"{found or 'none'}: remove the folder and install the wheel again")
    version = re.fullmatch(r"triton-(.+)\.dist-info", found[0]).group(1)
    env = subprocess_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join((str(folder), env["PYTHONPATH"]))
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"compiled for sm_90 with Triton {version}, 0 failed" in done.stdout, done.stdout[-500:]


def test_the_pair_instruction_count_compiles_both_passes_and_finds_the_amax_loop():
    """benchmarks/pair_instructions.py (the pair kernel's PTX and SASS a thread, compiled for sm_90): with
    every program taking PAIR_ITERS tiles, the amax pass's loop is found and is a tile's share;
    --lines names the kernels' source lines the instructions come from."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "pair_instructions.py"), "--programs", "1",
                           "--lines", "3", "--no-save"], env=subprocess_env(interpret=False), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    amax = next(line for line in done.stdout.splitlines() if line.startswith("x amax"))
    total, per_tile = (int(amax.split(": ")[1].split()[0]), int(amax.split(", ")[2].split()[0]))
    assert "8 a program" in amax and 0 < per_tile < total, amax
    assert sum(line.startswith(("x ", "dy ")) for line in done.stdout.splitlines()) == 4
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert len(lines) == 12 and all(int(n) > 0 for n, *_ in lines), done.stdout
    assert any(where.startswith("quantize.py:") and text for _, where, text, *_ in lines), done.stdout


def test_the_quantize_instruction_count_reads_every_launch_and_the_rotated_codes_take_the_parts_amax():
    """benchmarks/quantize_instructions.py (the single quantize kernel's SASS an element and
    registers, compiled for sm_90): six launches counted; the rotated codes pass, whose block amax
    comes from the butterfly's positions (quantize._rotated_with_amax), issues fewer instructions an
    element than the rotated values pass, which reduces the joined runs (before it: 62 against 52.5)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "quantize_instructions.py"), "--lines", "2",
                           "--no-save"], env=subprocess_env(interpret=False), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {tuple(line.split()[:2]): float(line.split(":")[1].split()[0])
            for line in done.stdout.splitlines() if "SASS an element" in line}
    assert len(rows) == 6 and all(v > 0 for v in rows.values()), done.stdout
    assert rows[("codes_rht_sr", "quantize")] < rows[("values_rht_sr", "quantize")], rows
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert len(lines) == 12 and all(int(n) > 0 for n, *_ in lines), done.stdout
