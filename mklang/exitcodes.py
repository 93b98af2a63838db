"""The CLI's exit codes, in one place (SPEC section 7)."""

OK = 0  # done; check clean; fmt canonical
HALT = 1  # run halted; a test scenario failed; fmt --check found changes; diff found a difference
KEPT = 1  # `runs rm`: a named run was kept (busy, unfinished, missing, not a checkpoint)
USAGE = 2  # load, check or usage error; a checkpoint that cannot be resumed
SUSPENDED = 3  # suspended, resumable
INTERRUPTED = 130  # interrupted without a checkpoint

# The outcome of a run, as `status` in its JSON and in scenario expectations.
STATUSES = ("done", "halted", "suspended")
EXIT_BY_STATUS = {"done": OK, "halted": HALT, "suspended": SUSPENDED}
