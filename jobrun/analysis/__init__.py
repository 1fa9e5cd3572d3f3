"""Reading what happened: deadlock logs, overlap rehearsals, timelines."""
