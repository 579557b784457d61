"""The multi-node deployment examples in docs/deploy: the sbatch script passes bash -n and shellcheck,
the JobSet's Job template and the dashboard Service pass the Kubernetes JSON schemas
(kubernetes-validate), and oomguard's own parser accepts the arguments they give it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oomguard.supervisor.cli import build_parser
from oomguard.supervisor.config import build_config
from oomguard.supervisor.distributed.coordination import EXIT_PEER_LOST
from oomguard.supervisor.lifecycle import EXIT_CRASHED

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy"
K8S_VERSION = "1.33.0"


def test_sbatch_script_parses() -> None:
    out = subprocess.run(["bash", "-n", str(DEPLOY / "oomguard.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("script", [DEPLOY / "oomguard.sbatch",
                                    DEPLOY.parent.parent / "scripts" / "gpu_check_torchrun.sh",
                                    DEPLOY.parent.parent / "scripts" / "gpu_check_peers.sh"])
def test_scripts_pass_shellcheck(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_gpu_check_peers_refuses_without_cuda(tmp_path: Path) -> None:
    """The prepared GPU check stops at once, exit 2 and one line, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the check would really run")
    script = DEPLOY.parent.parent / "scripts" / "gpu_check_peers.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert out.returncode == 2, out.stderr
    assert "no CUDA device" in out.stderr and list(tmp_path.iterdir()) == []


def test_sbatch_requeues_only_what_can_go_on() -> None:
    text = (DEPLOY / "oomguard.sbatch").read_text()
    assert f"{EXIT_PEER_LOST} | 143 | 130 | {EXIT_CRASHED})" in text and "scontrol requeue" in text
    assert "for code in 1 2 3 75 143 130 70; do" in text  # a give-up on any node outranks a requeue


def test_exit_70_is_restarted_in_every_place_that_says_so() -> None:
    """oomguard's own crash (70): lifecycle.py's table of exit codes, docs/multinode.md's table, the
    sbatch and the JobSet agree that a fresh start may pass it (a bounded number of times); issue 37 found
    them saying both."""
    from oomguard.supervisor import lifecycle as states

    assert re.search(r"^#\s+70 .*yes: a fresh start may pass it", Path(states.__file__).read_text(), re.M)
    table = (DEPLOY.parent / "multinode.md").read_text()
    assert re.search(r"^\| 70 \| oomguard's own unexpected error .*\| yes, a few times", table, re.M)
    sbatch = (DEPLOY / "oomguard.sbatch").read_text()
    assert "Never requeue" not in sbatch.split("*)", 1)[0] and "MAX_CRASH_REQUEUES" in sbatch
    jobset, _ = manifests()
    assert EXIT_CRASHED not in jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"][
        "rules"][0]["onExitCodes"]["values"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0


def test_sbatch_has_what_its_header_says_to_edit_and_an_output_path_that_exists() -> None:
    text = (DEPLOY / "oomguard.sbatch").read_text()
    assert "--output=%x-%j.out" in text  # the submit directory: no logs/ to create first
    for name in ("PROCS_PER_NODE", "TRAIN", "RUN_ROOT", "CHECKPOINTS", "RESUME_ARGS", "MICRO_BATCH",
                 "GLOBAL_BATCH", "OOMGUARD_ARGS"):
        assert re.search(rf"^{name}=\$\{{{name}:-", text, re.M), name
    assert "--label" in text and "--kill-on-bad-exit=0" in text


def manifests() -> list[dict]:  # type: ignore[type-arg]
    return list(yaml.safe_load_all((DEPLOY / "jobset.yaml").read_text()))


def test_jobset_job_template_and_service_pass_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jobset, service = manifests()
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    # A JobSet's replicated job template is a batch/v1 JobTemplateSpec: validate it as the Job it becomes.
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"pretrain-{replicated['name']}"},
               "spec": replicated["template"]["spec"]}
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail: a typo is caught
        bad = {**job, "spec": {**job["spec"], "paralelism": 2}}
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_jobset_gives_oomguard_options_it_accepts_and_fails_for_good_on_1_2_and_3() -> None:
    jobset, _ = manifests()
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in container["args"]]
    at = args.index("--")
    parsed = build_parser().parse_args(["run", *args[:at]])
    options = {k: v for k, v in vars(parsed).items() if k not in ("func", "subcommand")}
    config = build_config(options, args[at + 1:])
    shape = config.dist_shape
    # PyTorch's multi-node form: no node rank, c10d on the first pod's address
    assert shape is not None and (shape.nnodes, shape.node_rank, shape.nproc_per_node) == (2, None, 8)
    assert shape.rdzv_endpoint == "pretrain-node-0-0.pretrain:29400"
    assert config.world_size == 16 and config.initial_plan.grad_accum == 8
    assert job["completions"] == job["parallelism"] == shape.nnodes
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [1, 2, 3]  # lifecycle.py
