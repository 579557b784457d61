"""What it means and what to do next: pure functions of the facts (classify, policy, memory model)."""
