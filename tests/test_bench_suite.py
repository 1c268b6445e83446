"""`python -m jitney.bench.suite`: section selection and the machine header (the sections
themselves are the benchmarks tested in the other test_bench_* files)."""

from __future__ import annotations

from jitney.bench.suite import SECTIONS, machine_section, main


def test_machine_header_names_versions_and_commit():
    text = machine_section()
    assert text.startswith("## Machine and versions")
    assert "torch 2.13.0" in text and "transformers" in text and "jitney commit" in text


def test_unknown_sections_are_refused(capsys):
    assert main(["--sections", "slots,warp-drive"]) == 2
    err = capsys.readouterr().err
    assert "unknown sections warp-drive" in err and ", ".join(SECTIONS) in err
