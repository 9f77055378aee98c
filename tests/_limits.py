"""Time limits in tests exist to catch a hang, never to judge speed: a child process that takes 10 s alone on a quiet
machine took 90 s and more on a loaded 2-core CI machine, so every limit is many times what a run needs there."""

#: a subprocess or child process of a test (a script, a two-rank run): a hang, not a slow machine, runs past it
HANG_S = 600
