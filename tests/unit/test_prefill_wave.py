"""A prefill wave takes queued prompts while their padded chunk fits the token budget."""

from __future__ import annotations

from workers.engine.prefill_wave import most_prompts, wave_size


def test_short_prompts_fill_the_wave_up_to_the_most_prompts() -> None:
    assert wave_size([], [31] * 64, most=64, budget=4096, step=2048) == 64
    assert wave_size([], [31] * 64, most=32, budget=4096, step=2048) == 32


def test_the_budget_counts_every_prompt_at_the_longest_chunk() -> None:
    # 100 x 3 = 300 fits 320; a fourth prompt of 100 would not; a later long one lifts the chunk.
    assert wave_size([], [100, 100, 100, 100], most=64, budget=320, step=2048) == 3
    assert wave_size([], [10, 10, 200], most=64, budget=500, step=2048) == 2  # 3 x 200 > 500
    assert wave_size([], [5000, 5000], most=64, budget=4096, step=2048) == 2  # chunks of 2048


def test_one_prompt_always_goes_and_prompts_prefilling_stay() -> None:
    assert wave_size([], [9000], most=64, budget=16, step=2048) == 1
    assert wave_size([1500, 1500], [10], most=64, budget=4096, step=2048) == 2  # 3 x 1500 > 4096
    assert wave_size([10] * 5, [10, 10], most=4, budget=4096, step=2048) == 5


def test_a_wave_holds_at_most_the_prefill_batch_and_never_more_than_the_decode_batch() -> None:
    assert most_prompts(None, 32) == 32
    assert most_prompts(8, 32) == 8
    assert most_prompts(64, 32) == 32
