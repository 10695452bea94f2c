"""How a run ended, as pure functions of what was observed: what a process's output says, who failed first, the exit status, the summary."""
