# Warren's python fork server (crates/warren-node/src/function/fork.rs).
#
# Runs as `python3 -c` inside a container sandbox made exactly like a
# function worker. Three levels, so that no call's data ever sits in memory
# a later call is forked from:
#   zygote  - initialises the interpreter once, then only forks leaders; it
#             never reads a request or any output.
#   leader  - one per call, forked ahead of time: reads ONE request from the
#             control channel (fd 0), forks the user child, frames its
#             output onto fd 1, reports the exit (X), kills whatever the call
#             left and removes its SysV IPC, says so (D) and exits itself.
#   child   - forked by the leader before the request comes, does every
#             step that does not depend on the request then (so its
#             faults are not on the call's path), and on the
#             request enters its own Landlock domain and runs the user code
#             as `python3 -c` would.
# Frames, both ways: 1 byte kind, 4 bytes big-endian length, payload.
# A call costs CPU mostly in copy-on-write faults (each a page copy): the
# zygote runs once what would otherwise fault in every leader and child
# (a warm-up, a ruleset, the environment's clearing), files are read and
# written with os calls (no io objects), and leaders keep out of JSON (a
# request's stdin travels raw beside it; the exit report is formatted by
# hand).
# `resource` is imported here because os.wait4 imports it on first use: in
# a leader that would be a module import on every call's path.
import os, sys, json, struct, select, signal, ctypes, atexit, types, builtins, gc, resource

HEAD = struct.Struct(">cI")
# A C frame's payload: the request's length (4 bytes big-endian), the
# request (JSON, which only the child decodes), then the call's stdin (raw,
# which the leader writes).
REQUEST_LEN = struct.Struct(">I")
EXIT_REPORT = '{"killed": %s, "exit_code": %s, "signal": %s, "cpu_ns": %d, "peak_memory_bytes": %d}'
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
# Landlock (linux/landlock.h).
SYS_CREATE, SYS_ADD_RULE, SYS_RESTRICT = 444, 445, 446
RULE_PATH_BENEATH = 1
WRITE_FILE, TRUNCATE, IOCTL_DEV = 1 << 1, 1 << 14, 1 << 15
# write_file, remove_dir/file, make_char/dir/reg/sock/fifo/block/sym, refer, truncate, ioctl_dev
WRITE_CLASS = WRITE_FILE | sum(1 << b for b in range(4, 14)) | TRUNCATE | IOCTL_DEV
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
DEVICES = ("/dev/null", "/dev/zero", "/dev/full")
# Who a call runs as: not root. Landlock covers writes, not a file's mode,
# owner, times or extended attributes; root inside the sandbox owns the
# image's files and could change those of the fork server's (a mark the
# next call reads, or `chmod 0 /bin/sh` for it). `nobody` owns none.
CALL_UID = CALL_GID = 65534
SETUP_FAILED = 127
# A leader's exit status when the node closed the channel: the zygote ends.
LEADER_EOF = 3

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def syscall(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def prctl(option, value):
    if libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        e = ctypes.get_errno()
        raise OSError(e, "prctl(%d): %s" % (option, os.strerror(e)))


def send(kind, payload):
    data = HEAD.pack(kind, len(payload)) + payload
    while data:
        data = data[os.write(1, data):]


def read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def read_frame():
    kind, n = HEAD.unpack(read_exact(HEAD.size))
    return kind, read_exact(n)


def landlock_abi():
    return syscall(SYS_CREATE, None, ctypes.c_long(0), ctypes.c_long(1))


def add_rule(ruleset, path, rights):
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        rule = ctypes.create_string_buffer(struct.pack("<Qi", rights, fd))
        syscall(SYS_ADD_RULE, ctypes.c_long(ruleset), ctypes.c_long(RULE_PATH_BENEATH), rule, ctypes.c_long(0))
    finally:
        os.close(fd)


def new_ruleset():
    """A ruleset that allows writes only to a few devices; the call
    directory's rule is added once the request names it."""
    attr = ctypes.create_string_buffer(struct.pack("<QQQ", WRITE_CLASS, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL))
    ruleset = syscall(SYS_CREATE, attr, ctypes.c_long(24), ctypes.c_long(0))
    try:
        for d in DEVICES:
            add_rule(ruleset, d, WRITE_FILE | TRUNCATE | IOCTL_DEV)
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def restrict(ruleset, call_dir):
    """Writes only beneath call_dir (and to the devices); no signal,
    ptrace or abstract socket reaches outside the new domain."""
    try:
        add_rule(ruleset, call_dir, WRITE_CLASS)
        syscall(SYS_RESTRICT, ctypes.c_long(ruleset), ctypes.c_long(0))
    finally:
        os.close(ruleset)


def enter_own_domain(call_dir):
    restrict(new_ruleset(), call_dir)


def give_call_dir(call_dir):
    """Hands the call directory and the files the node wrote there to the
    call's user (only the node wrote in it: the call has not started)."""
    os.chown(call_dir, CALL_UID, CALL_GID, follow_symlinks=False)
    for parent, dirs, files in os.walk(call_dir):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), CALL_UID, CALL_GID, follow_symlinks=False)


def drop_root():
    """Becomes the call's user, which leaves every capability behind, and
    checks that it did."""
    os.setgroups([])
    os.setresgid(CALL_GID, CALL_GID, CALL_GID)
    os.setresuid(CALL_UID, CALL_UID, CALL_UID)
    if os.getresuid() != (CALL_UID,) * 3 or os.getresgid() != (CALL_GID,) * 3:
        raise OSError("the call is still root")
    fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = read_all(fd)
    finally:
        os.close(fd)
    caps = [line for line in status.splitlines() if line.startswith((b"CapEff:", b"CapPrm:"))]
    if len(caps) != 2 or any(int(line.split()[1], 16) for line in caps):
        raise OSError("the call kept capabilities: %r" % caps)
    # A change of user made the process non-dumpable. The zygote and
    # leaders stay so (a call cannot read their /proc/<pid>/environ or
    # mem); the call is dumpable, like `python3 -c` (its own /proc/self).
    prctl(PR_SET_DUMPABLE, 1)


def exit_code_of(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def read_all(fd):
    data = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return data
        data += chunk


# What a request looks like, for the zygote's warm-up.
WARM_REQUEST = json.dumps({"code": "print(6*7)", "args": [], "env": {"PATH": "/usr/bin:/bin", "HOME": "/work"},
                           "cwd": "/work"})


def warm_up():
    """Runs what every call runs - the JSON decoder, the compiler, the
    evaluation loop - on a throwaway request and code, in the zygote: the
    lazy state they set up on first use (caches, allocator pools) then
    exists before any fork instead of being made, page by page, in every
    child. Nothing of it is reachable afterwards. (Running it in each child
    too, before its request, moved fewer than 10 faults off the call's path
    for more CPU than that.)"""
    json.loads(WARM_REQUEST)
    exec(compile("_ = [str(6 * 7)]\n", "<warm-up>", "exec"), {"__builtins__": builtins})


def run_child(req_r, fds, status_w):
    """In the forked child: prepare what does not depend on the request,
    wait for it, isolate, then run the code as `python3 -c`."""
    in_r, out_w, err_w = fds
    ruleset, early = None, None
    try:
        # The OOM killer should take the call, never its leader or the zygote.
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"1000")
            finally:
                os.close(fd)
        except OSError:
            pass
        # fd 0 is closed until this dup2: the ruleset must not take it.
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        ruleset = new_ruleset()
    except BaseException as e:
        early = e
    payload = read_all(req_r)
    os.close(req_r)
    if not payload:
        os._exit(0)
    try:
        if early is not None:
            raise early
        req = json.loads(payload)
        cwd = req["cwd"]
        os.chdir(cwd)
        give_call_dir(cwd)
        restrict(ruleset, cwd)
        drop_root()
        os.write(status_w, b"ok")
        os.closerange(3, 1 << 20)
    except BaseException as e:
        try:
            os.write(status_w, ("cannot isolate the call: %r" % (e,)).encode())
        finally:
            os._exit(SETUP_FAILED)
    os.environ.update(req["env"])
    sys.argv = ["-c"] + req["args"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(req["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = exit_code_of(e)
    except BaseException:
        t, v, tb = sys.exc_info()
        # Drop this bootstrap's frame: the traceback starts at <string>, as with -c.
        v.__traceback__ = tb.tb_next
        sys.excepthook(t, v, tb.tb_next)
        code = 1
    try:
        atexit._run_exitfuncs()
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
    except SystemExit as e:
        code = exit_code_of(e)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def descendants():
    """Every process below this one (the leader is a subreaper, so orphans
    of the call are below it too)."""
    me = os.getpid()
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [me]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def no_children():
    """Whether this subreaper has no child left, so no descendant either
    (an orphan is re-parented to it before its parent can be reaped)."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def kill_everything():
    """SIGKILLs every process of the call and reaps it, until none is left."""
    # A call that left nothing running costs no walk of /proc.
    if no_children():
        return
    while True:
        alive = descendants()
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        reaped_any = False
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped_any = True
        if not alive and not reaped_any:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
        if not reaped_any:
            select.select([], [], [], 0.001)


def remove_ipc():
    """SysV IPC objects live in the sandbox's IPC namespace, not in a
    process: a call's would outlive it."""
    for kind, rm in (("shm", lambda i: libc.shmctl(i, 0, None)), ("sem", lambda i: libc.semctl(i, 0, 0)),
                     ("msg", lambda i: libc.msgctl(i, 0, None))):
        try:
            fd = os.open("/proc/sysvipc/" + kind, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            lines = read_all(fd).splitlines()[1:]
        finally:
            os.close(fd)
        for line in lines:
            fields = line.split()
            if len(fields) > 1:
                rm(int(fields[1]))


def run_call():
    """In the leader: one call, from the child's fork (before the request
    comes, so the fork is off the call's path) to the exit report."""
    req_r, req_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # Whatever happens in the child, it never returns into the leader's code.
        try:
            for fd in (0, req_w, in_w, out_r, err_r, status_r):
                os.close(fd)
            run_child(req_r, (in_r, out_w, err_w), status_w)
        finally:
            os._exit(SETUP_FAILED)
    for fd in (req_r, in_r, out_w, err_w, status_w):
        os.close(fd)
    # The leader's own share of a call's page copies, taken before it comes.
    exit_report(False, None, None)
    while True:
        try:
            kind, payload = read_frame()
        except EOFError:
            kill_everything()
            os._exit(LEADER_EOF)
        # A kill that crossed the end of the previous call is stale.
        if kind == b"C":
            break
    # The request, then the call's stdin: the leader never decodes the request.
    (n,) = REQUEST_LEN.unpack_from(payload)
    request = memoryview(payload)[REQUEST_LEN.size:REQUEST_LEN.size + n]
    stdin = payload[REQUEST_LEN.size + n:]
    while request:
        request = request[os.write(req_w, request):]
    os.close(req_w)
    status = b""
    while True:
        chunk = os.read(status_r, 4096)
        if not chunk:
            break
        status += chunk
    os.close(status_r)
    if status != b"ok":
        kill_everything()
        send(b"X", json.dumps({"setup_error": status.decode("utf-8", "replace") or "the child died"}).encode())
        return
    pidfd = os.pidfd_open(pid)
    for fd in (in_w, out_r, err_r):
        os.set_blocking(fd, False)
    if not stdin:
        os.close(in_w)
        in_w = None
    streams = {out_r: b"O", err_r: b"E"}
    killed, exit_status, rusage = False, None, None
    while exit_status is None:
        writers = [in_w] if in_w is not None else []
        readable, writable, _ = select.select(list(streams) + [pidfd, 0], writers, [])
        if in_w in writable:
            try:
                stdin = stdin[os.write(in_w, stdin[:65536]):]
            except BrokenPipeError:
                stdin = b""
            if not stdin:
                os.close(in_w)
                in_w = None
        for fd in readable:
            if fd in streams:
                pump(fd, streams)
            elif fd == 0:
                try:
                    kind, _ = read_frame()
                except EOFError:
                    kind = b"K"
                if kind == b"K":
                    killed = True
                    kill_everything()
            elif fd == pidfd:
                try:
                    _, exit_status, rusage = os.wait4(pid, 0)
                except ChildProcessError:
                    # kill_everything reaped it.
                    exit_status, rusage = -1, None
    # Output the call's other processes write until they die is kept too.
    for fd in list(streams):
        while pump(fd, streams):
            pass
    # When nothing else of the call is left (no output pipe held open, no
    # process) the exit is reported now and the IPC sweep follows it;
    # otherwise the rest is killed and its output drained first.
    if streams or not no_children():
        kill_everything()
        for fd in list(streams):
            os.set_blocking(fd, True)
            while fd in streams:
                pump(fd, streams)
    if in_w is not None:
        os.close(in_w)
    os.close(pidfd)
    send(b"X", exit_report(killed, exit_status, rusage))
    # The node answers the call on X but gives this zygote no new call
    # (nor removes the call directory) before D: nothing of this call may
    # be left then.
    kill_everything()
    remove_ipc()
    send(b"D", b"")


def exit_report(killed, exit_status, rusage):
    """The X frame's JSON, formatted by hand: a JSON encoder would touch
    (and so copy) pages of the zygote's in every leader."""
    exit_code, sig = None, None
    if exit_status is not None and exit_status >= 0:
        if os.WIFEXITED(exit_status):
            exit_code = os.WEXITSTATUS(exit_status)
        elif os.WIFSIGNALED(exit_status):
            sig = os.WTERMSIG(exit_status)
    elif killed:
        sig = signal.SIGKILL
    cpu_ns, peak = 0, 0
    if rusage is not None:
        cpu_ns = int((rusage.ru_utime + rusage.ru_stime) * 1e9)
        peak = rusage.ru_maxrss * 1024
    return (EXIT_REPORT % (killed and "true" or "false", "null" if exit_code is None else exit_code,
                           "null" if sig is None else int(sig), cpu_ns, peak)).encode()


def pump(fd, streams):
    """Moves what one output pipe holds to the channel; False when there
    was nothing to read (or the pipe ended)."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return False
    if data:
        send(streams[fd], data)
        return True
    del streams[fd]
    os.close(fd)
    return False


def lead():
    """A leader's life: one call, then exit."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    run_call()
    os._exit(0)


def probe():
    """A child that cannot enter its own domain fails the zygote, so that
    the node falls back to one-use workers (fail closed)."""
    abi = landlock_abi()
    if abi < 6:
        raise OSError("Landlock ABI %d < 6 (scoped signals and abstract sockets)" % abi)
    pid = os.fork()
    if pid == 0:
        try:
            enter_own_domain("/")
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError("a child cannot enter its own Landlock domain")
    return abi


def zygote():
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_DUMPABLE, 0)
    abi = probe()
    # A call's environment is exactly its request's: the children start
    # from none (cleared here once instead of in every child).
    os.environ.clear()
    warm_up()
    os.close(new_ruleset())
    # Objects made so far are never collected: a child's collector then
    # leaves their pages shared instead of touching (copying) them.
    gc.freeze()
    send(b"R", json.dumps({"pid": os.getpid(), "python": sys.version.split()[0], "landlock_abi": abi}).encode())
    while True:
        pid = os.fork()
        if pid == 0:
            try:
                lead()
            except BaseException:
                import traceback
                traceback.print_exc()
            os._exit(70)
        # The leader kills its call's processes; anything reparented here
        # despite that is killed with the next leader's exit.
        _, status = os.waitpid(pid, 0)
        kill_everything()
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == LEADER_EOF:
            return
        if status != 0:
            raise OSError("a call leader failed (status %d)" % status)


try:
    zygote()
except EOFError:
    pass
except BaseException as e:
    try:
        send(b"F", ("fork server: %r" % (e,)).encode())
    except BaseException:
        pass
    sys.exit(1)
