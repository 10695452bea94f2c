"""Attacks and faults, tried for real: port scans, impersonation, forged frames."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from multihost import env as env_lib
from multihost import launch

# Three processes: the first broadcast connects 0->1 and 1->2; the link 0<->2
# opens at the all-gather, after the attacks on process 2's listener.
_ATTACKS = textwrap.dedent('''
    import hashlib, hmac, os, socket, struct, sys, threading, time
    import numpy as np
    import multihost
    from multihost import lowlevel
    multihost.initialize()
    import jax
    me = jax.process_index()
    mode = sys.argv[1]
    big = np.arange(1 << 20, dtype=np.float32) + 1000 * me  # 4 MiB
    multihost.broadcast_one_to_all(big)

    def address(p):
      host, port = lowlevel.key_value_get(f'multihost_transport/{p}', 10).decode().rsplit('|', 1)
      return host, int(port)

    def recv_all(s):
      s.settimeout(10)
      out = b''
      while True:
        try:
          k = s.recv(4096)
        except OSError:
          return out
        if not k:
          return out
        out += k

    if me == 1 and mode == 'attack':
      target = address(2)
      slow = []
      for _ in range(300):  # a port scan: connect and close
        start = time.monotonic()
        socket.create_connection(target, timeout=20).close()
        if time.monotonic() - start > 0.9:
          slow.append(round(time.monotonic() - start, 2))
      # A SYN dropped by a full accept queue is sent again after 1 s: the
      # listener kept up with the scan only if connects did not wait that
      # long (one such wait is allowed: a descheduled scanner on 2 cores).
      assert len(slow) <= 1, f'scan connects took {slow} s'
      http = socket.create_connection(target, timeout=20)
      http.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')
      silent = socket.create_connection(target, timeout=20)  # never speaks
      # Out of range, wrong direction, and a peer with a wrong secret.
      for claim in (7, 2, 0):
        s = socket.create_connection(target, timeout=20)
        nonce = os.urandom(16)
        s.sendall(struct.pack('<4sII16s', b'MHT2', claim, 2, nonce))
        reply = s.recv(48)
        if claim != 0:
          assert reply == b'', (claim, reply)
          continue
        assert len(reply) == 48, reply
        proof = hmac.digest(b'wrong secret', b'connect', hashlib.sha256)
        s.sendall(proof)
        assert recv_all(s) == b'', 'a wrong secret was accepted'
      print('ATTACKS REFUSED', flush=True)

    # Process 2 republishes its address as a proxy that records and can
    # tamper with the bytes of the 0<->2 link.
    proxy = None
    if me == 2:
      class Proxy:
        def __init__(self, real):
          self.real = real
          self.sock = socket.socket()
          self.sock.bind(('127.0.0.1', 0))
          self.sock.listen(1)
          self.to_client = b''   # recorded bytes 2 -> 0
          self.to_server = b''   # recorded bytes 0 -> 2
          self.action = None
          threading.Thread(target=self.run, daemon=True).start()
        def run(self):
          client, _ = self.sock.accept()
          server = socket.create_connection(self.real)
          threading.Thread(target=self.pump, args=(client, server, 'to_server'), daemon=True).start()
          self.pump(server, client, 'to_client')
        def pump(self, src, dst, name):
          while True:
            data = src.recv(1 << 20)
            if not data:
              dst.close(); return
            if name == 'to_client' and self.action == 'flip':
              self.action = None
              data = bytes([data[0] ^ 1]) + data[1:]
            elif (name == 'to_client' and self.action == 'flip-payload'
                  and len(data) > 141):
              self.action = None  # a byte inside the pickled bytes' content
              data = data[:140] + bytes([data[140] ^ 1]) + data[141:]
            elif name == 'to_client' and self.action == 'truncate':
              self.action = None  # half a frame, then the connection ends
              dst.sendall(data[:len(data) // 2])
              for s in (dst, src):
                s.shutdown(socket.SHUT_RDWR)
              return
            elif name == 'to_client' and self.action == 'replay':
              self.action = None
              data = self.first_frame + data
            setattr(self, name, getattr(self, name) + data)
            dst.sendall(data)
      proxy = Proxy(address(2))
      lowlevel.key_value_set('multihost_transport/2',
                             f'127.0.0.1|{proxy.sock.getsockname()[1]}'.encode())
    multihost.sync_global_devices('attacked')

    start = time.monotonic()
    rows = multihost.process_allgather(big)
    took = time.monotonic() - start
    for p in range(3):
      np.testing.assert_array_equal(rows[p], np.arange(1 << 20, dtype=np.float32) + 1000 * p)
    print(f'GATHER OK in {took:.2f} s', flush=True)
    assert took < 5, took

    if me == 2:
      # Replay the recorded handshake of process 0 to the real listener.
      s = socket.create_connection(proxy.real, timeout=20)
      s.sendall(proxy.to_server[:28])
      reply = s.recv(48)
      if reply:
        s.sendall(proxy.to_server[28:60])
      assert recv_all(s) == b'', 'a replayed handshake was accepted'
      print('REPLAY REFUSED', flush=True)
    # Armed only once every process has the first gather: until process 0
    # passes this barrier, process 2's bytes of it may still be in the proxy.
    multihost.sync_global_devices('armed')
    if me == 2:
      block = 4 << 20
      proxy.first_frame = proxy.to_client[49:49 + 40 + block]  # after the handshake
      proxy.action = mode
    if mode == 'flip-payload':
      try:
        got = multihost.allgather_object(bytes([me]) * 300_000)
      except multihost.MultihostError as e:
        print('REFUSED:', e, flush=True)
      else:
        assert got == [bytes([p]) * 300_000 for p in range(3)], 'wrong bytes'
        print('DELIVERED CORRECT', flush=True)
    if mode in ('flip', 'replay', 'truncate'):
      try:
        rows = multihost.process_allgather(big)
      except multihost.MultihostError as e:
        print('REFUSED:', e, flush=True)
      else:
        for p in range(3):
          np.testing.assert_array_equal(rows[p], np.arange(1 << 20, dtype=np.float32) + 1000 * p)
        print('DELIVERED CORRECT', flush=True)
      if mode == 'truncate':  # stay alive while the others look for failures
        time.sleep(lowlevel.failure_detection_bound() + 3)
''')


def _run(tmp_path, mode):
  script = tmp_path / 'attacks.py'
  script.write_text(_ATTACKS)
  result = launch.launch([sys.executable, str(script), mode], num_processes=3,
                         devices_per_process=1, timeout=120,
                         env={env_lib.TIMEOUT: '30'})
  return result, result.outputs


def test_port_scan_and_impostors_are_refused_and_collectives_stay_prompt(
    tmp_path):
  result, outs = _run(tmp_path, 'attack')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'ATTACKS REFUSED' in outs[1], outs[1]
  assert 'REPLAY REFUSED' in outs[2], outs[2]
  assert all('GATHER OK' in out for out in outs), outs


def test_a_flipped_frame_header_raises_and_delivers_nothing(tmp_path):
  result, outs = _run(tmp_path, 'flip')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'failed authentication' in outs[0], outs[0]
  assert 'process 2 itself is not known to have failed' in outs[0], outs[0]


def test_an_altered_object_payload_is_never_unpickled(tmp_path):
  result, outs = _run(tmp_path, 'flip-payload')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'do not match the seal' in outs[0], outs[0]


def test_a_truncated_frame_raises_without_blaming_the_peer(tmp_path):
  result, outs = _run(tmp_path, 'truncate')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'no process is known to have failed' in outs[0], outs[0]
  assert 'process(es) [2] failed' not in outs[0], outs[0]


def test_a_replayed_frame_raises_and_delivers_nothing(tmp_path):
  result, outs = _run(tmp_path, 'replay')
  assert result.ok, result.summary + '\n'.join(outs)
  assert 'DELIVERED CORRECT' not in outs[0], outs[0]
  assert 'a replayed or reordered frame' in outs[0], outs[0]


# Someone who reaches the coordination service plants (or overwrites) a
# message that would run code if unpickled: it creates a file.
_TAMPER = textwrap.dedent('''
    import pickle, sys, threading, time
    import multihost
    from multihost import lowlevel
    multihost.initialize()
    import jax
    me = jax.process_index()
    mode, planted_file = sys.argv[1], sys.argv[2]

    class Evil:
      def __reduce__(self):
        return (open, (planted_file, 'w'))

    evil = b'D' + pickle.dumps(Evil())
    multihost.sync_global_devices('start')
    if me == 1 and mode == 'planted':
      for call in range(64):  # a key beside every process's own
        lowlevel.key_value_set(f'multihost/0/{call}/00', evil)
    if me == 1 and mode == 'altered':
      before = {k for k, _ in lowlevel.key_value_dir('multihost/')}
      def tamper():
        while True:
          for key, _ in lowlevel.key_value_dir('multihost/'):
            if key not in before and key.endswith('/0'):
              lowlevel.key_value_set(key, b'x' * 16 + evil)
              return
          time.sleep(0.005)
      thread = threading.Thread(target=tamper, daemon=True)
      thread.start()
      thread.join(20)
    if me == 0 and mode == 'altered':
      time.sleep(1)  # process 1's tamperer is watching when we publish
    if mode == 'planted':
      multihost.sync_global_devices('planted')
    try:
      got = multihost.allgather_object({'me': me})
    except multihost.MultihostError as e:
      print('REFUSED:', e, flush=True)
    else:
      print('GOT', got, flush=True)
''')


def _tamper(tmp_path, mode):
  script = tmp_path / 'tamper.py'
  script.write_text(_TAMPER)
  planted = tmp_path / 'code-ran'
  result = launch.launch([sys.executable, str(script), mode, str(planted)],
                         num_processes=2, devices_per_process=1, timeout=120,
                         env={env_lib.TIMEOUT: '30'})
  assert result.ok, result.summary + '\n'.join(result.outputs)
  assert not planted.exists(), 'the planted pickle ran'
  return result.outputs


def test_a_planted_key_is_refused_and_never_unpickled(tmp_path):
  outs = _tamper(tmp_path, 'planted')
  for out in outs:
    assert 'REFUSED' in out and 'is not the key of any process' in out, out


def test_an_altered_message_is_refused_and_never_unpickled(tmp_path):
  outs = _tamper(tmp_path, 'altered')
  for out in outs:
    assert 'REFUSED' in out and 'failed authentication' in out, out


def _alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie counts as gone)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except OSError:
    return False


def _wait_gone(pid: int, timeout: float) -> bool:
  deadline = time.monotonic() + timeout
  while _alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def test_a_controllers_orphaned_child_ends_with_the_run(tmp_path):
  script = tmp_path / 'orphan.py'
  script.write_text(textwrap.dedent('''
      import subprocess
      child = subprocess.Popen(['sleep', '1000'])
      print('CHILD', child.pid, flush=True)
  '''))
  result = launch.launch([sys.executable, str(script)], num_processes=1,
                         devices_per_process=1, timeout=60)
  pid = int(result.outputs[0].split('CHILD', 1)[1].split()[0])
  try:
    assert result.ok, result.summary
    assert _wait_gone(pid, 5), f'the orphan {pid} still runs'
  finally:
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)


def test_a_killed_launcher_leaves_no_controller_running(tmp_path):
  script = tmp_path / 'forever.py'
  script.write_text(textwrap.dedent('''
      import os, time
      print('PID', os.getpid(), flush=True)
      time.sleep(1000)
  '''))
  launcher = subprocess.Popen(
      [sys.executable, '-m', 'multihost.launch', '--num_processes=2',
       '--devices_per_process=1', '--', sys.executable, str(script)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pids = []
  try:
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
      line = launcher.stdout.readline()
      if not line:
        break
      if 'PID' in line:
        pids.append(int(line.split('PID', 1)[1].split()[0]))
    assert len(pids) == 2, pids
    launcher.kill()
    launcher.wait(10)
    for pid in pids:
      assert _wait_gone(pid, 5), f'controller {pid} outlived its launcher'
  finally:
    if launcher.poll() is None:
      launcher.kill()
    for pid in pids:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)


_BIND = textwrap.dedent('''
    import socket, sys
    import multihost
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
    multihost.initialize(f'127.0.0.1:{port}', 1, 0)
    listening = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
      for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == '0A' and int(local.rsplit(':', 1)[1], 16) == port:
          listening.append(local.rsplit(':', 1)[0])
    print('LISTENING', listening, flush=True)
''')


def test_initialize_binds_the_coordinator_to_its_own_host_only(tmp_path):
  script = tmp_path / 'bind.py'
  script.write_text(_BIND)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('JAX_', 'MULTIHOST_', 'SLURM_', 'OMPI_'))}
  out = subprocess.run([sys.executable, str(script)], env=env, timeout=120,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith('LISTENING')][0]
  # 127.0.0.1 (or ::ffff:127.0.0.1) as /proc/net/tcp* write it; never
  # 0.0.0.0 or [::].
  listening = eval(line.split(' ', 1)[1])  # noqa: S307 (our own list repr)
  loopback = {'0100007F', '0000000000000000FFFF00000100007F'}
  assert listening and set(listening) <= loopback, line


def test_a_readable_secret_file_is_refused(tmp_path):
  secret = tmp_path / 'secret'
  secret.write_text('0123456789abcdef')
  secret.chmod(0o644)
  script = tmp_path / 'bulk.py'
  script.write_text(textwrap.dedent('''
      import numpy as np
      import multihost
      multihost.initialize()
      try:
        multihost.broadcast_one_to_all(np.zeros(1 << 20, np.float32))
      except multihost.MultihostError as e:
        print('REFUSED:', e, flush=True)
  '''))
  result = launch.launch([sys.executable, str(script)], num_processes=2,
                         devices_per_process=1, timeout=120,
                         env={env_lib.JOB_SECRET_FILE: str(secret),
                              env_lib.TIMEOUT: '20'})
  assert 'REFUSED:' in result.outputs[0], result.outputs[0][-3000:]
  assert f'chmod 600 {secret}' in result.outputs[0], result.outputs[0]
  secret.chmod(0o600)
  result = launch.launch([sys.executable, str(script)], num_processes=2,
                         devices_per_process=1, timeout=120,
                         env={env_lib.JOB_SECRET_FILE: str(secret)})
  assert result.ok and not any('REFUSED' in o for o in result.outputs), (
      result.summary + '\n'.join(result.outputs))
