"""PMIx, through its C library: process 0's string given to every process of an Open MPI 5 job.

Why this module exists: under Open MPI 5's `mpirun` (PRRTE) only process 0
knows where it will listen, and nothing in the other processes' environment
says where process 0 runs. Every process of such a job is a client of the
PMIx server of its node (PRRTE's daemon, or `mpirun` itself), which stores
what a process commits and gives it to the job's other processes, across
nodes through PRRTE's daemons. The client library (libpmix) comes with Open
MPI 5 itself; it is reached here with ctypes, through the PMIx standard's
stable C interface (PMIx_Init, _Put, _Commit, _Get, _Fence, _Finalize), so
no Python package is needed. Nothing here opens a socket of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os

from multihost import env

# The PMIx standard's sizes and codes (pmix_common.h, PMIx 3 and later).
_NSPACE_BYTES = 256  # PMIX_MAX_NSLEN + 1
_KEY_BYTES = 512  # PMIX_MAX_KEYLEN + 1
_STRING = 3  # PMIX_STRING
_INT = 6  # PMIX_INT
_GLOBAL = 3  # PMIX_GLOBAL: visible to every process of the job
_TIMEOUT = b'pmix.timeout'  # PMIX_TIMEOUT (int, seconds)
_ERR_TIMEOUT = -24  # PMIX_ERR_TIMEOUT
# Our key: process 0's string (one job's keys are the job's own).
_KEY = b'multihost.coordinator'


class PmixError(RuntimeError):
  """PMIx's library is missing or one of its calls failed (the message names the call)."""


class _Proc(ctypes.Structure):
  _fields_ = [('nspace', ctypes.c_char * _NSPACE_BYTES),
              ('rank', ctypes.c_uint32)]


class _Data(ctypes.Union):
  # The members used here, and room for the largest (pmix_envar_t).
  _fields_ = [('string', ctypes.c_char_p), ('integer', ctypes.c_int),
              ('room', ctypes.c_byte * 24)]


class _Value(ctypes.Structure):
  _fields_ = [('type', ctypes.c_uint16), ('data', _Data)]


class _Info(ctypes.Structure):
  _fields_ = [('key', ctypes.c_char * _KEY_BYTES),
              ('flags', ctypes.c_uint32), ('value', _Value)]


def library_paths() -> list[str]:
  """Where libpmix may be, best first: beside the running Open MPI, then the system's."""
  found = []
  for variable in (env.PMIX_PREFIX, env.OPAL_PREFIX):
    prefix = os.environ.get(variable)
    if prefix:
      for pattern in ('lib*/libpmix.so*', 'lib*/*/libpmix.so*'):
        found += sorted(glob.glob(os.path.join(prefix, pattern)))
  system = ctypes.util.find_library('pmix')
  if system:
    found.append(system)
  return list(dict.fromkeys(found))


# The PMIx standard's C signatures of the calls used here: (name, argument
# types, result type). pmix_status_t is an int; pmix_key_t a char array
# passed as a string; pmix_scope_t a uint8.
_SIGNATURES = (
    ('PMIx_Init', (ctypes.POINTER(_Proc), ctypes.POINTER(_Info),
                   ctypes.c_size_t), ctypes.c_int),
    ('PMIx_Finalize', (ctypes.POINTER(_Info), ctypes.c_size_t), ctypes.c_int),
    ('PMIx_Put', (ctypes.c_uint8, ctypes.c_char_p, ctypes.POINTER(_Value)),
     ctypes.c_int),
    ('PMIx_Commit', (), ctypes.c_int),
    ('PMIx_Get', (ctypes.POINTER(_Proc), ctypes.c_char_p,
                  ctypes.POINTER(_Info), ctypes.c_size_t,
                  ctypes.POINTER(ctypes.POINTER(_Value))), ctypes.c_int),
    ('PMIx_Fence', (ctypes.POINTER(_Proc), ctypes.c_size_t,
                    ctypes.POINTER(_Info), ctypes.c_size_t), ctypes.c_int),
)
# PMIx 4 and later; absent from older libraries.
_VALUE_FREE = ('PMIx_Value_free', (ctypes.POINTER(_Value), ctypes.c_size_t),
               None)


def _declare(lib: ctypes.CDLL) -> None:
  """Declares each call's argument and result types on `lib` (ctypes then checks every call's arguments)."""
  for name, argtypes, restype in _SIGNATURES:
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = restype
  free = getattr(lib, _VALUE_FREE[0], None)
  if free is not None:
    free.argtypes = list(_VALUE_FREE[1])
    free.restype = _VALUE_FREE[2]


def _load() -> ctypes.CDLL:
  tried = []
  for path in library_paths():
    try:
      lib = ctypes.CDLL(path)
    except OSError as e:
      tried.append(f'{path} ({e})')
      continue
    _declare(lib)
    return lib
  raise PmixError(
      'found no loadable PMIx client library (libpmix, part of Open MPI 5) '
      f'under ${env.PMIX_PREFIX}, ${env.OPAL_PREFIX} or the system\'s '
      f'libraries; tried: {", ".join(tried) or "none found"}')


def available() -> bool:
  """Whether a libpmix can be loaded (it comes with Open MPI 5)."""
  try:
    _load()
  except PmixError:
    return False
  return True


def _timeout_info(seconds: float) -> _Info:
  info = _Info()
  info.key = _TIMEOUT
  info.value.type = _INT
  info.value.data.integer = max(1, int(seconds))
  return info


def _check(status: int, call: str, seconds: float) -> None:
  if status == _ERR_TIMEOUT:
    raise PmixError(f'{call} timed out after {int(seconds)} s: a process of '
                    'the job did not get there (did every rank call '
                    'multihost.initialize()?)')
  if status != 0:
    raise PmixError(f'{call} failed with PMIx status {status}')


def share_from_first(value: str | None, *, timeout: float) -> str:
  """Process 0's `value`, in every process of this PMIx job (the others pass None).

  Every process of the job must call it. Process 0 puts its value in PMIx's
  store, the others get it from there (waiting for it up to `timeout`
  seconds), then all meet at a fence, and leave PMIx (PRRTE reports a
  client that exits without leaving).

  Where mpi4py is installed, MPI is started first (by importing it): PMIx
  cannot start again in a process once left, so the program's own
  MPI_Init after this would fail or abort at MPI_Finalize; with MPI
  started first, PMIx counts this use as a second start and stays up for
  MPI. (Both seen with Open MPI 5.0.11: an MPI_Init after a finished use
  aborted at MPI_Finalize; one during a kept use failed, "local rank: Not
  found".)

  Raises:
    PmixError: no libpmix, or a call failed or timed out (named).
  """
  lib = _load()
  if importlib.util.find_spec('mpi4py') is not None:
    # Starts MPI (mpi4py starts it at import).
    from mpi4py import MPI  # noqa: F401  pylint: disable=unused-import
  me = _Proc()
  _check(lib.PMIx_Init(ctypes.byref(me), None, ctypes.c_size_t(0)),
         'PMIx_Init', timeout)
  try:
    return _share(lib, me, value, timeout)
  finally:
    lib.PMIx_Finalize(None, ctypes.c_size_t(0))


def _share(lib: ctypes.CDLL, me: _Proc, value: str | None,
           timeout: float) -> str:
  wait = _timeout_info(timeout)
  if me.rank == 0:
    if value is None:
      raise PmixError('process 0 has no value to share')
    mine = _Value()
    mine.type = _STRING
    mine.data.string = value.encode()
    _check(lib.PMIx_Put(ctypes.c_uint8(_GLOBAL), _KEY, ctypes.byref(mine)),
           'PMIx_Put', timeout)
    _check(lib.PMIx_Commit(), 'PMIx_Commit', timeout)
    shared = value
  else:
    first = _Proc()
    first.nspace = me.nspace
    first.rank = 0
    got = ctypes.POINTER(_Value)()
    _check(lib.PMIx_Get(ctypes.byref(first), _KEY, ctypes.byref(wait),
                        ctypes.c_size_t(1), ctypes.byref(got)),
           f'PMIx_Get of process 0\'s {_KEY.decode()}', timeout)
    if not got or got.contents.type != _STRING:
      raise PmixError(f'PMIx_Get of process 0\'s {_KEY.decode()} gave no '
                      'string')
    shared = got.contents.data.string.decode()
    release = getattr(lib, 'PMIx_Value_free', None)  # PMIx 4 and later.
    if release is not None:
      release(got, ctypes.c_size_t(1))
  _check(lib.PMIx_Fence(None, ctypes.c_size_t(0), ctypes.byref(wait),
                        ctypes.c_size_t(1)), 'PMIx_Fence', timeout)
  return shared

