"""After a restart the dashboard's header shows the step the new attempt resumed from, not the
previous attempt's last step (issue 35): through the real HTTP API of a real run."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from harness import start_run

# Attempt 1 takes 25 steps (checkpoints at 10 and 20) and waits; a later attempt is slow to start
# (a big model loading), so for a while it has reported no step of its own.
WORKER = textwrap.dedent('''
    import json, os, time
    from pathlib import Path

    def record(**fields):
        with open(os.environ["OOMGUARD_EVENTS"], "a") as fh:
            fh.write(json.dumps({"type": "progress", "t": time.time(), **fields}) + "\\n")

    step = int(os.environ.get("OOMGUARD_CHECKPOINT_STEP") or 0)
    if int(os.environ["OOMGUARD_ATTEMPT"]) > 1:
        time.sleep(60)
    folder = Path(os.environ["CKPT_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    while step < 25:
        step += 1
        record(step=step, total_steps=100)
        if step % 10 == 0:
            (folder / f".step-{step}.tmp").write_bytes(b"x" * 1024)
            os.replace(folder / f".step-{step}.tmp", folder / f"step-{step}.pt")
        time.sleep(0.02)
    time.sleep(60)
''')


def test_the_header_after_a_restart_shows_the_resumed_step(tmp_path: Path) -> None:
    worker = tmp_path / "slow_resume.py"
    worker.write_text(WORKER)
    run = start_run(tmp_path, micro=4, global_batch=4, command=(sys.executable, str(worker)))
    try:
        run.wait_for(lambda d: (d["progress"] or {}).get("step") == 25 and d["newest_checkpoint"] is not None
                     and d["newest_checkpoint"]["step"] == 20, timeout=60)
        assert run.post("api/control/restart", headers={"Authorization": f"Bearer {run.token}"}).status_code == 202
        doc = run.wait_for(lambda d: d["attempt"] == 2 and d["state"] == "running", timeout=60)
        doc = run.wait_for(lambda d: (d["progress"] or {}).get("source") == "resume_point", timeout=20)
        progress = doc["progress"]
        assert progress["step"] == 20 and progress["attempt"] == 2, progress  # not attempt 1's 25
        assert progress["total_steps"] == 100 and progress["checkpoint"].endswith("step-20.pt"), progress
        text = run.cli("status")
        assert "progress:   step 20/100 [resumed from its checkpoint]" in text.stdout, text.stdout
        # The dashboard's header renders doc.progress.step (app.js progressText) and says where it came from.
        js = (Path(__file__).resolve().parents[3] / "oomguard" / "web" / "static" / "app.js").read_text()
        assert 'p.source === "resume_point"' in js and "step ${p.step}" in js
    finally:
        run.stop()
