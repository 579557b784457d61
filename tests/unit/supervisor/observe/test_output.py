"""The output scanner pinned where mutation testing (bench/mutation.py) found it loose: which line of
each kind it keeps (the first, but an exception message over the source line a traceback quotes),
the bounded tail and frames, and the one-line readers the rank scanner uses."""

from __future__ import annotations

from oomguard.supervisor.observe.output import OutputScanner, device_oom_line, host_oom_line

QUOTED = "    raise torch.OutOfMemoryError(msg)"
MESSAGE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def scan(*lines: str) -> OutputScanner:
    s = OutputScanner()
    for line in lines:
        s.feed(line)
    return s


def test_the_exception_message_beats_the_source_line_a_traceback_quotes_before_it() -> None:
    s = scan("Traceback (most recent call last):", QUOTED, MESSAGE)
    assert s.device_oom == MESSAGE
    assert scan(" raise torch.OutOfMemoryError(msg)", MESSAGE).device_oom == MESSAGE  # one space is a quote too


def test_a_quoted_line_alone_is_kept_marked_and_the_first_quote_stays() -> None:
    assert scan(QUOTED).device_oom == " raise torch.OutOfMemoryError(msg)"
    assert scan(QUOTED, "      raise torch.OutOfMemoryError(other)").device_oom == " raise torch.OutOfMemoryError(msg)"


def test_the_first_message_of_each_kind_is_kept() -> None:
    second = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB."
    assert scan(MESSAGE, second).device_oom == MESSAGE
    assert scan(MESSAGE, QUOTED).device_oom == MESSAGE
    assert scan("MemoryError: first", "MemoryError: second").host_oom == "MemoryError: first"
    assert scan("OSError: [Errno 28] No space left on device: 'a'",
                "OSError: [Errno 28] No space left on device: 'b'").disk_full.endswith("'a'")  # type: ignore[union-attr]
    assert scan("_pickle.UnpicklingError: invalid load key, 'x'.", "EOFError: Ran out of input").load_error == (
        "_pickle.UnpicklingError: invalid load key, 'x'.")
    first = "RuntimeError: DataLoader worker (pid 11) is killed by signal: Killed."
    assert scan(first, "RuntimeError: DataLoader worker (pid 12) exited unexpectedly").dataloader == first


def test_every_line_is_counted_and_the_tail_keeps_the_newest_twenty_to_forty() -> None:
    lines = [f"step {i}" for i in range(41)]
    s = scan(*lines[:40])
    assert s.lines == 40 and s.tail == lines[:40]
    s.feed(lines[40])
    assert s.lines == 41 and s.tail == lines[-20:]


def test_a_deep_traceback_keeps_its_outermost_200_frames() -> None:
    frames = [f'  File "m.py", line {i}, in f{i}' for i in range(250)]
    s = scan("Traceback (most recent call last):", *frames)
    assert s.frames == [f"f{i}" for i in range(200)]


def test_the_one_line_readers_strip_a_match_and_refuse_the_rest() -> None:
    assert device_oom_line(f"  {MESSAGE}\n") == MESSAGE
    assert device_oom_line("step 3 loss 0.2") is None
    assert host_oom_line("  MemoryError: \n") == "MemoryError:"
    assert host_oom_line("step 3 loss 0.2") is None
