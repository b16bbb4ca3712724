"""layerzoo.runtime.malloc: after tune_malloc, a large tensor comes from the heap (not a fresh mmap) and its
memory stays in the heap after it is freed, ready for the next step's tensor of the same size."""

import subprocess
import sys
import textwrap

import pytest

from layerzoo.runtime.malloc import glibc, tune_malloc

pytestmark = pytest.mark.skipif(glibc() is None or not hasattr(glibc(), "mallinfo2"), reason="needs glibc >= 2.33")

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from layerzoo.runtime.malloc import glibc, tune_malloc

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = glibc()
    libc.mallinfo2.restype = MallInfo2
    tuned = tune_malloc() if sys.argv[1] == "tuned" else False
    import torch

    before = libc.mallinfo2()
    x = torch.empty(16 << 20, dtype=torch.float32).fill_(1)  # 64 MiB
    alive = libc.mallinfo2()
    del x
    freed = libc.mallinfo2()
    mib = lambda n: n / 2**20
    print(json.dumps(dict(tuned=tuned, mmapped_alive=mib(alive.hblkhd - before.hblkhd),
                          heap_alive=mib(alive.arena - before.arena), heap_after_free=mib(freed.arena - before.arena))))
""")


def probe(mode: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "LAYERZOO_MALLOC_TUNING": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_large_tensors_come_from_the_heap_and_stay_there():
    plain, tuned = probe("plain"), probe("tuned")
    assert plain["mmapped_alive"] >= 64  # glibc's default: a fresh mapping, unmapped on free
    assert tuned["tuned"] is True
    assert tuned["mmapped_alive"] < 1 and tuned["heap_alive"] >= 64
    assert tuned["heap_after_free"] >= 64  # not trimmed: the next 64 MiB tensor reuses these pages


def test_the_user_or_the_switch_turns_it_off(monkeypatch):
    import layerzoo.runtime.malloc as malloc

    for env in ({"LAYERZOO_MALLOC_TUNING": "0"}, {"MALLOC_MMAP_THRESHOLD_": "65536"}):
        monkeypatch.setattr(malloc, "_tuned", None)
        assert tune_malloc(env) is False
