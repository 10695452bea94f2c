"""Programs that the multi-process tests start (one module each, run by path).

Each is a `main()` under `if __name__ == '__main__'`, so importing one (as
tests/multiprocess/test_programs.py does) runs nothing. They print markers that the
tests read; `tests/_helpers.program(name, *args)` is the command line.
"""
