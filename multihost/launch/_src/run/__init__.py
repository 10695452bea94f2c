"""One run of N controllers: the command line, `launch()`, `Controllers` and what a run holds, one attempt's steps, the merged trace."""
