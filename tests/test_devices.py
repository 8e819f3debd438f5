"""Whether a device computes bfloat16 in hardware: read from the CPU's flags as the kernel reports them."""

import torch

from headkit import devices


def test_cpu_flags_are_the_first_flags_line_and_empty_without_the_file(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert devices.cpu_flags(info) == {"fpu", "avx512f", "avx512_bf16"}
    assert devices.cpu_flags(tmp_path / "absent") == frozenset()
    info.write_text("processor\t: 0\n")
    assert devices.cpu_flags(info) == frozenset()


def test_bfloat16_is_native_on_a_cpu_with_avx512_bf16_or_amx_only(monkeypatch):
    cpu = torch.device("cpu")
    for flags, native in [
        ({"avx512f", "avx512_bf16"}, True),
        ({"amx_bf16", "amx_tile"}, True),
        ({"avx512f", "avx2"}, False),
        (set(), False),
    ]:
        monkeypatch.setattr(devices, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert devices.native_bfloat16(cpu) is native
    assert devices.native_bfloat16(torch.device("meta")) is False
