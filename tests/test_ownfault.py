"""The rule that tells oomguard's own failures from the script's (decide/classify.py), fed tracebacks
as the worker prints them, and the policy that follows from it (decide/policy.py)."""

from __future__ import annotations

import os

import pytest

from oomguard.common.batch import BatchPlan
from oomguard.probe import SITE_DIR
from oomguard.supervisor.decide.classify import Addition, FailureKind, OwnFault, own_fault
from oomguard.supervisor.decide.policy import Action, Failure, Plan, PolicyConfig, decide
from oomguard.supervisor.observe.output import OutputScanner
from oomguard.supervisor.run.runtime import OWN_CODE
from oomguard.supervisor.run.spare import BOOTSTRAP

PKG = OWN_CODE.roots[0]
TORCH = "/venv/lib/python3.12/site-packages/torch"
BOTH = frozenset(Addition)


def scanned(text: str, after: int = 0) -> OutputScanner:
    scan = OutputScanner()
    for line in text.splitlines():
        scan.feed(line)
    for n in range(after):
        scan.feed(f"a line of output {n}")
    return scan


def fault(text: str, kind: FailureKind = FailureKind.CRASH, in_use: frozenset[Addition] = BOTH,
          after: int = 0) -> OwnFault | None:
    return own_fault(kind, scanned(text, after), in_use, OWN_CODE)


PROBE_HOOK = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 20, in <module>
    loss = model(x).sum()
  File "{TORCH}/nn/modules/module.py", line 1776, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "{TORCH}/nn/modules/module.py", line 1850, in _call_impl
    hook_result = hook(self, args, result)
  File "{PKG}/probe/forward.py", line 85, in post
    self._learned.setdefault(id(module), self._leaves)
AttributeError: 'NoneType' object has no attribute 'setdefault'
'''

# The torch.compile failure: dynamo raised while tracing the probe's hook.
DYNAMO = f'''Traceback (most recent call last):
  File "/home/u/gpt/train.py", line 300, in <module>
    logits, loss = model(X, Y)
  File "{TORCH}/_dynamo/eval_frame.py", line 655, in _fn
    return fn(*args, **kwargs)
  File "{TORCH}/_dynamo/symbolic_convert.py", line 1100, in run
    while self.step():
  File "{TORCH}/_dynamo/side_effects.py", line 300, in track_object_existing
    assert not self.is_attribute_mutation(item)
AssertionError: UnspecializedNNModuleVariable(LM) is already tracked for mutation. This could be because it was
  passed to the hook twice

from user code:
   File "{PKG}/probe/forward.py", line 77, in pre
    if self._depth == 0 or module is self._root:

Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're reporting a bug to PyTorch).
'''

# The program's own exception, raised by its object's __getstate__ inside the save our wrapper passed on.
THROUGH_SAVE = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 30, in <module>
    torch.save({{"state": Bad()}}, "ckpt.pt")
  File "{PKG}/probe/saves.py", line 45, in save
    result = original(obj, f, *args, **kwargs)  # its exception is the program's
  File "{TORCH}/serialization.py", line 966, in save
    _save(obj, opened_zipfile, pickle_module, pickle_protocol, _disable_byteorder_record)
  File "{TORCH}/serialization.py", line 1209, in _save
    pickler.dump(obj)
  File "/home/u/proj/train.py", line 8, in __getstate__
    raise RuntimeError("the user's own error")
RuntimeError: the user's own error
'''

# The user's sys.excepthook, which ours chains to, raising: Python prints that, then the original.
THROUGH_EXCEPTHOOK = f'''Error in sys.excepthook:
Traceback (most recent call last):
  File "{PKG}/probe/oom.py", line 85, in excepthook
    previous(kind, exc, tb)
  File "/home/u/proj/train.py", line 4, in hook
    raise ValueError("the user's hook fails")
ValueError: the user's hook fails

Original exception was:
Traceback (most recent call last):
  File "/home/u/proj/train.py", line 30, in <module>
    step(batch)
  File "/home/u/proj/train.py", line 22, in step
    raise KeyError("label")
KeyError: 'label'
'''

HANDOVER = f'''Traceback (most recent call last):
  File "{BOOTSTRAP}", line 189, in <module>
    main()
  File "{BOOTSTRAP}", line 186, in main
    _become(json.loads(text))
  File "{BOOTSTRAP}", line 144, in _become
    _run_as_main(str(spec["script"]))
  File "{BOOTSTRAP}", line 156, in _run_as_main
    with io.open_code(path) as fh:
IsADirectoryError: [Errno 21] Is a directory: '/home/u/proj/app'
'''


def test_the_probes_own_frame_innermost_is_ours() -> None:
    own = fault(PROBE_HOOK)
    assert own == OwnFault(Addition.PROBE, "oomguard/probe/forward.py, line 85, in post")
    assert own.reason == ("oomguard's probe failed (oomguard/probe/forward.py, line 85, in post); the next attempt "
                          "runs without the probe")


def test_dynamo_failing_in_the_probes_hook_is_ours() -> None:
    own = fault(DYNAMO)
    assert own is not None and own.addition is Addition.PROBE
    assert own.frame == "oomguard/probe/forward.py, line 77, in pre"


def test_the_programs_exception_through_our_save_wrapper_or_excepthook_is_the_scripts() -> None:
    assert fault(THROUGH_SAVE) is None
    assert fault(THROUGH_EXCEPTHOOK) is None
    # torch's own error inside the save our wrapper passed on (a full disk, a pickling error): the script's
    torch_error = THROUGH_SAVE.split('  File "/home/u/proj/train.py", line 8')[0] + "OSError: [Errno 28]\n"
    assert fault(torch_error) is None


def test_a_spares_handover_is_ours_only_in_an_attempt_handed_to_a_spare() -> None:
    own = fault(HANDOVER)
    assert own is not None and own.addition is Addition.SPARE and own.frame.startswith(
        "oomguard/supervisor/run/sparestart.py, line 156, in _run_as_main")
    assert "starts cold, without spares" in own.reason
    assert fault(HANDOVER, in_use=frozenset({Addition.PROBE})) is None
    assert fault(PROBE_HOOK, in_use=frozenset({Addition.SPARE})) is None  # --no-probe: not the probe's
    # The script's exception after the handover: its frames innermost, whatever ran before it.
    script = HANDOVER.replace("    with io.open_code(path) as fh:\nIsADirectoryError: [Errno 21] Is a directory: "
                              "'/home/u/proj/app'", '''    exec(code, main.__dict__)
  File "/home/u/proj/train.py", line 3, in <module>
    import wandb
ModuleNotFoundError: No module named 'wandb\'''')
    assert fault(script) is None


def test_a_spare_that_had_exited_before_its_handover_is_ours_whatever_ended_the_attempt() -> None:
    lost = "it had exited before the handover, killed by SIGKILL"
    for kind in (FailureKind.HOST_OOM, FailureKind.KILLED, FailureKind.CRASH):
        own = own_fault(kind, scanned(""), BOTH, OWN_CODE, lost)
        assert own == OwnFault(Addition.SPARE, lost)  # the script never ran: not its batch's
    assert own_fault(FailureKind.HOST_OOM, scanned(""), frozenset({Addition.PROBE}), OWN_CODE, lost) is None


def test_the_worker_library_is_the_probes_only_when_the_probe_called_it() -> None:
    library = f'''Traceback (most recent call last):
  File "/home/u/proj/train.py", line 12, in <module>
    {{}}
  File "{PKG}/common/protocol.py", line 90, in emit
    os.write(fd, data)
OSError: [Errno 9] Bad file descriptor
'''
    by_probe = library.format(f'''opt.step()
  File "{PKG}/probe/steps.py", line 120, in report
    channel.emit(protocol.STEP, step=self.step)
  File "{PKG}/probe/channel.py", line 37, in emit
    protocol.emit(record_type, **fields, **identity())''')
    own = fault(by_probe)
    assert own is not None and own.addition is Addition.PROBE and own.frame.startswith("oomguard/common/protocol.py")
    assert fault(library.format("oomguard.common.protocol.emit('progress', step=3)")) is None  # the script's call


def test_only_a_crash_whose_traceback_ended_the_output_is_ours() -> None:
    assert fault(PROBE_HOOK, FailureKind.HOST_OOM) is None  # memory ran out where our code happened to allocate
    assert fault(PROBE_HOOK, after=45) is not None
    assert fault(PROBE_HOOK, after=60) is None  # printed and survived: the program logged it and went on
    # A later traceback of the program's own replaces ours.
    assert fault(PROBE_HOOK + THROUGH_SAVE) is None
    assert fault("exit code 1, no traceback\n") is None


def test_our_code_is_where_the_worker_is_handed_it() -> None:
    assert OWN_CODE.addition_of(os.path.join(SITE_DIR, "sitecustomize.py")) is Addition.PROBE
    assert OWN_CODE.addition_of(BOOTSTRAP) is Addition.SPARE
    assert OWN_CODE.addition_of(os.path.join(PKG, "supervisor", "run", "loop.py")) is None
    assert OWN_CODE.addition_of("/elsewhere/oomguard/probe/forward.py") is None  # another install's


# ----- the policy


PLAN = Plan(BatchPlan(8, 16))
CONFIG = PolicyConfig(max_restarts=2)
OURS = OwnFault(Addition.PROBE, "oomguard/probe/forward.py, line 85, in post")


def crash(attempt: int, own: OwnFault | None = None) -> Failure:
    return Failure(attempt, FailureKind.CRASH, 8, "exit code 1", own=own)


def test_our_failure_restarts_at_once_at_the_same_batch_without_the_addition() -> None:
    decision = decide(crash(1, OURS), [], PLAN, CONFIG)
    assert decision.action is Action.RESTART and decision.plan == PLAN and decision.delay == 0
    assert decision.turn_off is Addition.PROBE and decision.reason == OURS.reason


@pytest.mark.parametrize("ours", [1, 2])
def test_our_failures_are_not_counted_against_the_script(ours: int) -> None:
    history = [crash(n, OURS if n <= ours else None) for n in range(1, 3)]
    # Counted: --max-restarts 2 would be used up and the same crash three times would be a crash loop.
    decision = decide(crash(3), history, PLAN, CONFIG)
    assert decision.action is Action.RESTART and decision.turn_off is None
    assert decision.delay == CONFIG.backoff * 2 ** (2 - ours)  # the backoff counts the script's crashes only
    counted = decide(crash(3), [crash(1), crash(2)], PLAN, CONFIG)
    assert counted.action is Action.GIVE_UP  # as before for the script's own


def test_a_second_failure_of_the_same_addition_counts_as_the_scripts() -> None:
    """It is off after its first: a second would be a bug of ours, and must not restart the run for ever."""
    decision = decide(crash(2, OURS), [crash(1, OURS)], PLAN, PolicyConfig(max_restarts=0))
    assert decision.action is Action.GIVE_UP and decision.turn_off is None
    spare = OwnFault(Addition.SPARE, "oomguard/supervisor/run/sparestart.py, line 156, in _run_as_main")
    assert decide(crash(2, spare), [crash(1, OURS)], PLAN, CONFIG).turn_off is Addition.SPARE
