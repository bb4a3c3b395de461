"""A reward of 0 that takes half a second: added to a recipe, it leaves every advantage (and so every loss) as it
was and makes each step long enough for a test to stop a run between two checkpoints."""

import time


def slow_zero_reward(completions, **kwargs):
    time.sleep(0.5)
    return [0.0] * len(completions)
