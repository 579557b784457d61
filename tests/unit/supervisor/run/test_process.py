"""expandable_segments:True is merged into the allocator settings under the names torch reads."""

from __future__ import annotations

from oomguard.supervisor.run.process import alloc_conf, expandable_already, merge_alloc_conf

NEW, OLD = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"


def test_unset_sets_both_names() -> None:
    assert merge_alloc_conf({}) == {NEW: "expandable_segments:True", OLD: "expandable_segments:True"}


def test_a_user_who_set_the_new_name_keeps_their_settings_under_both() -> None:
    merged = merge_alloc_conf({NEW: "max_split_size_mb:128"})
    assert merged[NEW] == "max_split_size_mb:128,expandable_segments:True"
    assert merged[OLD] == merged[NEW]  # an older torch reads only the old name


def test_both_set_each_keeps_its_own_and_an_explicit_false_is_replaced() -> None:
    merged = merge_alloc_conf({NEW: "expandable_segments:False,garbage_collection_threshold:0.6",
                               OLD: "max_split_size_mb:64"})
    assert merged[NEW] == "garbage_collection_threshold:0.6,expandable_segments:True"
    assert merged[OLD] == "max_split_size_mb:64,expandable_segments:True"


def test_already_set_is_read_from_the_name_that_wins() -> None:
    assert expandable_already({OLD: "expandable_segments:True"})
    assert expandable_already({NEW: "expandable_segments: True"})
    assert not expandable_already({NEW: "max_split_size_mb:64", OLD: "expandable_segments:True"})
    assert alloc_conf({NEW: "a:1", "PATH": "/bin"}) == {NEW: "a:1"}


