"""bitnest-doctor on this CPU machine: the kernels' self-tests through the CPU emulator (the
runner seam a Mac fills with Metal), the pure-path decode, the Markdown and the JSON whose every
field docs/doctor.md documents."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from bitnest_mlx import kernels
from bitnest_mlx.cli import doctor
from bitnest_mlx.cli.doctor_kernels import CHECKS, Recorder, replay_gbps, run_checks
from bitnest_mlx.kernels import emulator

DOCS = Path(__file__).resolve().parents[1] / "docs" / "doctor.md"
needs_cxx = pytest.mark.skipif(
    shutil.which(emulator.cxx()) is None, reason=f"the Metal emulator needs {emulator.cxx()}"
)


def _args(*argv: str):
    return doctor.build_parser().parse_args(["--max-tokens", "4", *argv])


@pytest.fixture(scope="module")
def emulated_report() -> dict:
    if shutil.which(emulator.cxx()) is None:
        pytest.skip(f"the Metal emulator needs {emulator.cxx()}")
    return doctor.collect(_args(), runner=emulator.run)


def test_every_kernel_compiles_and_passes_its_self_test_in_the_emulator(emulated_report):
    k = emulated_report["kernels"]
    assert k["runner"] == "emulator" and not k["available"]
    assert k["compiled"] == {spec.name: "yes" for spec in kernels.SPECS}
    assert [c["name"] for c in k["checks"]] == [c.name for c in CHECKS]
    assert all(c["compiled"] and c["self_test"] == "passed" for c in k["checks"])
    assert all(c["gbps"] is None for c in k["checks"])  # an emulator's speed means nothing


def test_the_demo_decodes_on_the_pure_path_and_reports_its_speeds(emulated_report):
    d = emulated_report["decode"]
    assert d["kernels_vs_pure"] is None  # no Metal: nothing to compare
    assert min(d["draft_tps"], d["target_tps"], d["speculative_tps"]) > 0
    assert 0 <= d["acceptance"] <= 1


def test_verify_cost_is_timed_on_the_pure_path_beside_the_table(emulated_report):
    v = emulated_report["verify_cost"]
    assert v["kernel"]["measured"] is None  # no Metal: the kernel path does not run
    measured = v["pure"]["measured"]
    assert measured["1"] == 1.0 and all(x > 0 for x in measured.values())
    assert v["table_chip"] is None  # this CPU is not in the table


def test_verify_report_prints_the_table_of_a_known_chip():
    from bitnest_mlx.cli import doctor_verify
    from bitnest_mlx.runtime.speed_model import verify_cost

    v = doctor_verify.verify_report(False, "Apple M4 Max", repeats=1)
    assert v["table_chip"] == "M4 Max"
    assert v["pure"]["table"] == {
        str(m): verify_cost(m, "M4 Max", "pure") for m in (1, 2, 4, 8, 16)
    }
    assert "| pure, table (M4 Max) | 1.00 |" in "\n".join(doctor_verify.markdown(v))


def _paths(value, prefix: str = "") -> set[str]:
    """Field paths of a JSON value: `a.b`, a list's items as `a[].b`."""
    whole = ("kernels_vs_pure", "verify_cost.pure", "verify_cost.kernel", "verify_cost.shape")
    if isinstance(value, dict) and not prefix.endswith(whole):  # documented whole
        out = set()
        for key, v in value.items():
            # Maps keyed by kernel name are one documented field each (`compiled.<kernel>`).
            name = f"{prefix}.<kernel>" if prefix.endswith("compiled") else f"{prefix}.{key}"
            out |= _paths(v, name) or {name}
        return out
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return set().union(*(_paths(v, f"{prefix}[]") for v in value))
    return {prefix} if prefix else set()


def _documented_fields() -> set[str]:
    """The first column of docs/doctor.md's JSON table."""
    text = DOCS.read_text(encoding="utf-8")
    table = text[text.index("<!-- doctor-json-fields -->") :].split("\n\n")[1]
    return {"." + m for m in re.findall(r"^\| `([^`]+)` \|", table, re.M)}


def test_every_json_field_is_documented_and_every_documented_field_is_there(
    emulated_report, capsys
):
    fields = _paths(emulated_report)
    assert fields == _documented_fields()
    # On a machine with Metal, kernels_vs_pure is an object: its fields are documented too.
    assert doctor.main(["--json", "--max-tokens", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == doctor.SCHEMA and report["kernels"]["reason"]
    assert _paths(report) <= fields | {".kernels.compiled", ".kernels.checks"}  # empty here


def test_markdown_report_has_the_machine_the_kernel_table_and_the_decode(emulated_report):
    text = doctor.markdown(emulated_report)
    assert text.startswith("# bitnest-doctor report")
    assert "/ MLX /" in text and mx.__version__ in text
    assert "| check | kernels | compiled | self-test | GB/s | of peak |" in text
    assert text.count("| passed |") == len(CHECKS)
    assert "| speculative |" in text and "Kernels on vs off: not compared" in text


@needs_cxx
def test_a_kernel_reading_the_wrong_weight_group_fails_its_self_test_and_exits_1():
    def planted(launch):
        return emulator.run(launch, mutate=lambda src: src.replace("k0 / GS", "k0 / 128"))

    found = run_checks(planted, 0, False, None, CHECKS[:3])
    verdicts = [c["self_test"].split(":")[0] for c in found["checks"]]
    assert verdicts == ["failed", "failed", "passed"]  # groups 32 and 64; 128 is unaffected


def _zeros(launch: kernels.Launch) -> list[mx.array]:
    """A runner that plans nothing on a GPU: the launch's outputs, zero."""
    return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]


def test_a_kernel_that_does_not_compile_is_named_and_its_checks_fail():
    def no_merge(launch):
        if launch.spec.name == kernels.NESTED_KV_MERGE.name:
            raise RuntimeError("Unable to build metal library from source\nerror: ...")
        return _zeros(launch)

    attention = tuple(c for c in CHECKS if c.name.startswith("nested-KV"))
    found = run_checks(no_merge, 0, False, None, attention)
    assert found["compiled"][kernels.NESTED_KV_MERGE.name] == (
        "RuntimeError: Unable to build metal library from source"
    )
    assert found["compiled"][kernels.NESTED_KV.name] == "yes"
    assert found["compiled"][kernels.DUAL_PLANE.name] == "not launched"
    assert all(not c["compiled"] and c["self_test"].startswith("failed") for c in found["checks"])


def test_the_timed_shapes_plan_valid_launches_of_megabytes():
    """The decode-sized shapes only run on a Mac; here each plans its launches (a runner that
    returns zeros), so a shape the kernels refuse fails here first."""
    from bitnest_mlx.cli.doctor_kernels import streamed_bytes

    for check in CHECKS:
        rec = Recorder(_zeros)
        check.run(rec, True)
        assert rec.launches and streamed_bytes(rec.launches) > 1 << 20, check.name


@needs_cxx
def test_replayed_launches_give_a_bandwidth():
    rec = Recorder(emulator.run)
    CHECKS[2].run(rec, False)
    assert replay_gbps(rec.launches, emulator.run, repeats=1) > 0
