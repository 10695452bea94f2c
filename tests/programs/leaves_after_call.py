"""Every process passes JAX's own barrier inside `multihost.call_watched`; process 1 then exits at once, while process 0's call goes on for 3 s more (as Orbax's primary finishes a commit alone).

Process 0 prints `CALL done; exited: [1]` once its call has returned (the
list: the processes recorded in the exit store by then); then it makes
another watched call, which needs no peer (as Orbax's wait for a commit the
others have finished their part of), prints `LATER CALL done` and exits 0.
"""

from __future__ import annotations

import time

import multihost
from multihost._src.liveness import exit_handshake
from multihost._src.runtime import runtime


def main() -> None:
  multihost.initialize()
  import jax  # noqa: PLC0415 (after initialize)
  from jax.experimental import multihost_utils  # noqa: PLC0415

  me = jax.process_index()

  def commit():
    multihost_utils.sync_global_devices('commit')
    if me == 0:
      time.sleep(3)  # Process 1 leaves meanwhile; its watchdog sees it.
    return 'done'

  result = multihost.call_watched(commit, op='commit', timeout=60)
  if me == 0:
    exited = sorted(exit_handshake.exited_processes(runtime.current().client))
    print(f'CALL {result}; exited: {exited}', flush=True)
    later = multihost.call_watched(lambda: 'done', op='later', timeout=60)
    print(f'LATER CALL {later}', flush=True)


if __name__ == '__main__':
  main()
