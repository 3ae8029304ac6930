"""Generation engine: draft tree builder, target verify/commit, the step loop, statistics, the Drafter interface."""
