"""The cluster spec format, its presets, and ``pipeplan cluster``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from pipeplan.cli import app
from pipeplan.facts.gpus import GPUS
from pipeplan.cluster.presets import PRESETS, resolve_cluster
from pipeplan.errors import BadInputError
from pipeplan.formats.cluster import ClusterSpec, load_cluster_file

runner = CliRunner()

GOOD = """
name = "my-cluster"
gpu = "h100-sxm"
gpus_per_node = 8
memory_cap = "80GB"

[intra_node]
bandwidth = "450GB/s"
latency_us = 3.4

[inter_node]
bandwidth_bytes_per_s = 50e9
latency_us = 14
efficiency = 0.7
"""


def _write(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_presets_are_valid_and_name_known_gpus():
    assert set(PRESETS) == {"dgx-h100", "dgx-a100", "gh200", "dgx-b200", "dgx-h200", "dgx-b300", "gb200-nvl72",
                            "gb300-nvl72", "pcie-l4"}
    for name, spec in PRESETS.items():
        assert spec.name == name
        assert spec.gpu in GPUS  # the GPU table holds its memory, FLOP/s and HBM bandwidth
        assert spec.memory_cap_bytes is None and spec.cap_bytes() == GPUS[spec.gpu].memory_bytes
        assert spec.intra_node.bandwidth_bytes_per_s > spec.inter_node.bandwidth_bytes_per_s
        assert ClusterSpec.model_validate(spec.model_dump()) == spec  # round-trips


def test_dgx_h100_figures():
    spec = PRESETS["dgx-h100"]
    assert (spec.gpus_per_node, spec.intra_node.bandwidth_bytes_per_s, spec.inter_node.bandwidth_bytes_per_s) == (
        8, 450e9, 50e9)


def test_toml_file_reads_quantities(tmp_path):
    spec = load_cluster_file(_write(tmp_path, GOOD))
    assert spec.memory_cap_bytes == 80 * 10**9
    assert spec.intra_node.bandwidth_bytes_per_s == 450e9
    assert spec.inter_node.achieved_bytes_per_s == pytest.approx(35e9)
    assert resolve_cluster(str(tmp_path / "c.toml")) == spec


def test_toml_file_based_on_a_preset(tmp_path):
    spec = load_cluster_file(_write(tmp_path, 'base = "dgx-a100"\nname = "half"\ngpus_per_node = 4\n'
                                               '[inter_node]\nbandwidth = "12.5GB/s"\n'), PRESETS)
    assert spec.gpus_per_node == 4 and spec.gpu == "a100-80gb"
    assert spec.inter_node.bandwidth_bytes_per_s == 12.5e9
    assert spec.inter_node.latency_us == PRESETS["dgx-a100"].inter_node.latency_us
    assert spec.intra_node == PRESETS["dgx-a100"].intra_node


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace('gpus_per_node = 8\n', ''), "c.toml: gpus_per_node: missing field"),
    (lambda t: t.replace('latency_us = 3.4', 'latency_us = -1'), "c.toml: intra_node.latency_us: Input should be greater than or equal to 0"),
    (lambda t: t.replace('gpus_per_node = 8', 'gpus_per_node = -8'), "c.toml: gpus_per_node: Input should be greater than 0"),
    (lambda t: t.replace('bandwidth = "450GB/s"', 'bandwidth = "fast"'), "c.toml: intra_node: bandwidth: 'fast' is not a bandwidth"),
    (lambda t: t.replace('[inter_node]', '[network]'), "c.toml: inter_node: missing field"),
    (lambda t: t + 'colour = "green"\n', "colour"),
    (lambda t: t.replace('efficiency = 0.7', 'efficiency = 1.5'), "c.toml: inter_node.efficiency"),
    (lambda t: t.replace('gpus_per_node = 8', 'gpus_per_node = ['), "c.toml: not valid TOML"),
])
def test_bad_cluster_files_name_the_field(tmp_path, edit, message):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(BadInputError) as info:
        load_cluster_file(path)
    assert message in str(info.value)
    result = runner.invoke(app, ["cluster", str(path)])
    assert result.exit_code == 2
    assert message in result.output


def test_unknown_names(tmp_path):
    with pytest.raises(BadInputError, match="neither a preset"):
        resolve_cluster("dgx-z9")
    with pytest.raises(BadInputError, match="no such file"):
        resolve_cluster(str(tmp_path / "missing.toml"))
    with pytest.raises(BadInputError, match="base: 'dgx-z9' is not a preset"):
        load_cluster_file(_write(tmp_path, 'base = "dgx-z9"\n'), PRESETS)
    spec = load_cluster_file(_write(tmp_path, GOOD.replace('gpu = "h100-sxm"', 'gpu = "tpu-v5"')
                                    .replace('memory_cap = "80GB"\n', '')))
    with pytest.raises(BadInputError, match="give memory_cap"):
        spec.cap_bytes()


def test_cluster_command_lists_presets():
    result = runner.invoke(app, ["cluster"])
    assert result.exit_code == 0, result.output
    for name in PRESETS:
        assert name in result.output
    assert "450 GB/s" in result.output
    one = runner.invoke(app, ["cluster", "gh200"])
    assert one.exit_code == 0 and "gh200" in one.output and "dgx-h100" not in one.output


def test_cluster_command_as_a_subprocess(tmp_path):
    path = _write(tmp_path, GOOD.replace("latency_us = 14", "latency_us = -14"))
    proc = subprocess.run([sys.executable, "-m", "pipeplan", "cluster", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "inter_node.latency_us" in proc.stderr and "Traceback" not in proc.stderr
