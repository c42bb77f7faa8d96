"""The CPU profile: one capability model, read once, capped by
``$PAGEDKV_CPU_ISA`` together with torch's and oneDNN's own caps, and the C kernels' -march."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedkv import cpu_isa
from pagedkv.cpu_isa import ENV, apply_env, build_profile, cap_env, capped, isa_class, onednn_min, parse_cap
from pagedkv.errors import ConfigError

BASE = {"avx2", "fma", "f16c", "bmi2", "sse4_2"}
EPYC = BASE | {"sha_ni"}  # AVX2-only: no AVX-512, no VNNI, no AMX
ICELAKE = BASE | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512dq"}
SPR = ICELAKE | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
ALDERLAKE = BASE | {"avx_vnni"}


def test_the_cap_names_its_valid_values():
    assert [parse_cap(v) for v in (None, "", "  ", " AVX2 ", "avx512", "Amx", "native")] == [
        "native", "native", "native", "avx2", "avx512", "amx", "native"]
    for bad in ("avx", "sse4", "avx-512", "avx2,avx512", "x86-64-v3"):
        with pytest.raises(ConfigError, match=r"PAGEDKV_CPU_ISA: unsupported .* \(one of avx2, avx512, amx, native\)"):
            parse_cap(bad)


def test_classes_from_flags():
    assert [isa_class(f) for f in (set(), {"avx2"}, EPYC, ALDERLAKE, ICELAKE, SPR)] == [
        "default", "default", "avx2", "avx2", "avx512", "amx"]
    assert isa_class(ICELAKE - {"avx512vl"}) == "avx2"  # AVX-512 F/BW/VL all three, or not the class


def test_a_cap_clears_what_is_above_it_and_refuses_what_the_cpu_lacks():
    assert capped(SPR, "native") == ("amx", SPR & set(cpu_isa.FLAGS))
    assert capped(SPR, "avx2") == ("avx2", {"avx2", "fma", "f16c", "bmi2"})
    assert capped(ALDERLAKE, "avx2")[1] == {"avx2", "fma", "f16c", "bmi2"}  # AVX-VNNI too: no VNNI in the class
    klass, flags = capped(SPR, "avx512")
    assert klass == "avx512" and "avx512_bf16" in flags and not flags & {"amx_tile", "amx_int8", "amx_bf16"}
    with pytest.raises(ConfigError,
                       match=r"PAGEDKV_CPU_ISA=amx: this CPU is avx512 \(avx2 .*avx512_vnni\); use avx2, avx512, native"):
        capped(ICELAKE, "amx")
    with pytest.raises(ConfigError, match="this CPU is avx2 .* use avx2, native"):
        capped(EPYC, "avx512")
    with pytest.raises(ConfigError, match=r"this CPU is default \(no AVX2\); use native"):
        capped({"sse4_2"}, "avx2")


def test_the_cap_sets_torch_and_onednn_to_match():
    assert cap_env("native", SPR) == {}
    assert cap_env("avx2", SPR) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cap_env("avx2", ALDERLAKE) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cap_env("avx512", ICELAKE) == {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                                          "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    assert cap_env("avx512", SPR)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert cap_env("amx", SPR) == {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
    assert cap_env("avx512", ICELAKE - {"avx512_vnni"})["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"


def test_apply_env_sets_only_what_the_user_did_not_and_never_raises():
    env = {ENV: "avx2"}
    assert apply_env(env, SPR) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = {ENV: "avx2", "ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "SSE41",
           "MKL_ENABLE_INSTRUCTIONS": "AVX"}  # the user's stay
    before = dict(env)
    assert apply_env(env, SPR) == {} and env == before
    for env in ({}, {ENV: "native"}, {ENV: "junk"}, {ENV: "amx"}):  # no cap, or one profile() reports
        before = dict(env)
        assert apply_env(env, ICELAKE) == {} and env == before


def test_onednn_isa_under_its_cap():
    assert onednn_min("AVX512_CORE_AMX", None) == "AVX512_CORE_AMX"
    assert onednn_min("AVX512_CORE_AMX", "avx2") == "AVX2"
    assert onednn_min("AVX512_CORE_VNNI", "AVX10_1_512_AMX") == "AVX512_CORE_VNNI"  # a cap above: the CPU's
    assert onednn_min("AVX512_CORE_AMX", "AVX10_1_512") == "AVX512_CORE_FP16"
    assert onednn_min("AVX2", "ALL") == "AVX2" and onednn_min("AVX2", "DEFAULT") == "AVX2"


def test_profile_fields_and_record():
    p = build_profile(SPR, "avx2", "AVX2", environ={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert (p.isa, p.native_isa, p.cap, p.aten_capability, p.onednn_isa, p.onednn_cap) == (
        "avx2", "amx", "avx2", "AVX2", "AVX2", "AVX2")
    assert p.flags() == ["avx2", "fma", "f16c", "bmi2"] and not p.vnni and not p.amx and not p.avx512_bf16
    d = p.as_dict()
    assert d["isa"] == "avx2" and d["flags"] == p.flags() and d["vnni"] is False and "march" in d
    json.dumps(d)
    assert "capped by PAGEDKV_CPU_ISA=avx2; CPU: amx" in p.summary()
    native = build_profile(SPR, "native", "AVX512", environ={})
    assert native.isa == "amx" and native.vnni and native.amx and native.onednn_isa == "AVX512_CORE_AMX"
    assert "capped" not in native.summary()
    # a cap that torch did not follow (it was imported first, or the user set ATEN_CPU_CAPABILITY)
    assert "but ATen runs AVX512" in build_profile(SPR, "avx2", "AVX512", environ={}).summary()


def test_cpuinfo_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma f16c\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_isa.read_cpuinfo(str(f)) == {"fpu", "avx2", "fma", "f16c"}
    assert cpu_isa.read_cpuinfo(str(tmp_path / "none")) is None


def test_march_follows_the_cap(monkeypatch):
    for value, want in ((None, "-march=native"), ("native", "-march=native"), ("avx512", "-march=native"),
                        ("avx2", "-march=x86-64-v3"), (" AVX2 ", "-march=x86-64-v3"), ("junk", "-march=native")):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        assert cpu_isa.march_flags() == [want]


def test_this_process_runs_its_profile():
    # under the CI's second pass (PAGEDKV_CPU_ISA=avx2) this is the AVX2 profile on any host
    from pagedkv.ops import cpu_kernel
    from pagedkv.model import quant

    p = cpu_isa.profile()
    assert p.cap == parse_cap(os.environ.get(ENV))
    assert p.native_isa == isa_class(cpu_isa.read_cpuinfo() or set()) or cpu_isa.read_cpuinfo() is None
    f = quant.cpu_features()
    assert (f.vnni, f.amx, f.avx512_bf16, f.capability) == (p.vnni, p.amx, p.avx512_bf16, p.aten_capability)
    assert cpu_isa.march_flags()[0] in cpu_kernel._FLAGS
    if p.cap == "avx2":
        assert p.isa == "avx2" and p.aten_capability == "AVX2" and not f.int8_exact and "VNNI" in f.int8_refusal
        assert cpu_kernel._FLAGS.count("-march=x86-64-v3") == 1


_PROBE = (
    "import json, os, pagedkv, torch\n"
    "from pagedkv import cpu_isa\n"
    "from pagedkv.model import quant\n"
    "out = {'aten': str(torch.backends.cpu.get_cpu_capability()),\n"
    "       'env': {k: os.environ.get(k) for k in ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA',\n"
    "                                              'MKL_ENABLE_INSTRUCTIONS')}}\n"
    "try:\n"
    "    f = quant.cpu_features()\n"
    "    out.update(vnni=f.vnni, int8_exact=f.int8_exact, isa=cpu_isa.profile().isa,\n"
    "               auto=quant.resolve_weights('auto')[1], march=cpu_isa.march_flags())\n"
    "except pagedkv.ConfigError as e:\n"
    "    out['error'] = str(e)\n"
    "print(json.dumps(out))\n"
)


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in (ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env={**clean, **env},
                       timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_avx2_cap_reaches_torch_onednn_and_the_routes():
    native = isa_class(cpu_isa.read_cpuinfo() or set())
    got = _probe(**{ENV: "avx2"})
    if native == "default":  # no AVX2 here: the cap is above this CPU
        assert "this CPU is default" in got["error"]
        return
    assert got["aten"] == "AVX2" and got["env"] == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert got["vnni"] is False and got["int8_exact"] is False and got["isa"] == "avx2"
    assert "capability AVX2" in got["auto"] and "qmm) at every batch size" in got["auto"]
    assert got["march"] == ["-march=x86-64-v3"]
    # the user's own torch cap stays; oneDNN's is still set
    got = _probe(**{ENV: "avx2", "ATEN_CPU_CAPABILITY": "default"})
    assert got["aten"] == "DEFAULT" and got["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2" and got["int8_exact"] is False


def test_a_bad_or_too_high_cap_is_a_config_error_at_first_use():
    got = _probe(**{ENV: "avx3"})  # import pagedkv works; the profile refuses
    assert "one of avx2, avx512, amx, native" in got["error"] and got["env"]["ONEDNN_MAX_CPU_ISA"] is None
    native = isa_class(cpu_isa.read_cpuinfo() or set())
    order = cpu_isa.CLASSES.index
    above = next((c for c in ("avx2", "avx512", "amx") if order(c) > order(native)), None)
    if above is not None:  # (an AMX host has no class above its own)
        got = _probe(**{ENV: above})
        assert f"PAGEDKV_CPU_ISA={above}: this CPU is {native}" in got["error"]
        assert got["env"] == {"ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": None, "MKL_ENABLE_INSTRUCTIONS": None}


def test_benchmarks_record_the_profile():
    from pagedkv.bench.common import machine_info

    rec = machine_info(1)["cpu_isa"]
    assert rec == cpu_isa.profile().as_dict() and {"isa", "flags", "aten_capability", "onednn_isa", "march"} <= set(rec)
