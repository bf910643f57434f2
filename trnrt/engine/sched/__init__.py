"""Scheduling (pure Python): which requests run in the next step, how many tokens each, in which
order (schedule policies, priorities, the queue limit) and what preemption frees."""
