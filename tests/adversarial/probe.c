/* The adversarial suite's probe: one static binary, uploaded into the
 * sandbox, that makes the system calls a shell cannot. Every subcommand
 * prints one line per attempt, `<what> <ret> <errno-name>`, so the suite
 * can tell a refusal (EPERM from seccomp) from an absent feature. It never
 * sends a packet anywhere but to the addresses it is given, and the suite
 * only gives loopback or reserved documentation addresses (TEST-NET,
 * 2001:db8::/32) in sandboxes without egress. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>

static char buf[4096];

static const char *ename(int e) {
    switch (e) {
    case 0: return "OK";
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case EACCES: return "EACCES";
    case ENOSYS: return "ENOSYS";
    case EINVAL: return "EINVAL";
    case EBADF: return "EBADF";
    case EFAULT: return "EFAULT";
    case ENOTTY: return "ENOTTY";
    case ETXTBSY: return "ETXTBSY";
    case ENXIO: return "ENXIO";
    case ECONNREFUSED: return "ECONNREFUSED";
    case ENETUNREACH: return "ENETUNREACH";
    case EHOSTUNREACH: return "EHOSTUNREACH";
    case EAFNOSUPPORT: return "EAFNOSUPPORT";
    case EADDRNOTAVAIL: return "EADDRNOTAVAIL";
    case ETIMEDOUT: return "ETIMEDOUT";
    case EINPROGRESS: return "EINPROGRESS";
    case EPROTONOSUPPORT: return "EPROTONOSUPPORT";
    case ESRCH: return "ESRCH";
    case EROFS: return "EROFS";
    case EMFILE: return "EMFILE";
    case ENOSPC: return "ENOSPC";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    case ENOTSOCK: return "ENOTSOCK";
    case EISDIR: return "EISDIR";
    case EXDEV: return "EXDEV";
    default: return "EOTHER";
    }
}

static void report(const char *what, long ret, int err) {
    printf("%s %ld %s\n", what, ret, ret < 0 ? ename(err) : "OK");
}

static unsigned long arg(const char *s) {
    return strcmp(s, "buf") == 0 ? (unsigned long)buf : strtoull(s, 0, 0);
}

/* sys NR [ARG...]: one raw system call. */
static int cmd_sys(int argc, char **argv) {
    unsigned long a[6] = {0};
    long nr = strtol(argv[0], 0, 0);
    for (int k = 0; k < 6 && k + 1 < argc; k++) a[k] = arg(argv[k + 1]);
    pid_t me = getpid();
    errno = 0;
    long ret = syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
    int err = errno;
    if (getpid() != me) _exit(0); /* a clone that went through */
    char what[64];
    snprintf(what, sizeof what, "sys%ld", nr);
    report(what, ret, err);
    return 0;
}

/* ioctl PATH CMD: the command on a file the sandbox owns. */
static int cmd_ioctl(char **argv) {
    int fd = open(argv[0], O_RDWR | O_CREAT, 0644);
    if (fd < 0) fd = open(argv[0], O_RDONLY);
    if (fd < 0) { report("open", -1, errno); return 0; }
    errno = 0;
    long ret = ioctl(fd, (unsigned long)strtoul(argv[1], 0, 0), buf);
    report("ioctl", ret, errno);
    return 0;
}

/* struct xfs_swapext, x86_64 (see warren-guard's seccomp.rs for the size). */
struct xfs_swapext {
    int64_t sx_version, sx_fdtarget, sx_fdtmp, sx_offset, sx_length;
    char sx_pad[16];
    char sx_stat[136];
};
struct xfs_exchange_range {
    int32_t file1_fd;
    uint32_t pad;
    uint64_t file1_offset, file2_offset, length, flags;
};
#define XFS_IOC_SWAPEXT 0xc0c0586dUL
#define XFS_IOC_EXCHANGE_RANGE 0x40285881UL

/* xfs TARGET TMP: both XFS extent-swapping ioctls, the way the incident
 * used them: TARGET is the file to read, TMP one the caller owns. */
static int cmd_xfs(char **argv) {
    int target = open(argv[0], O_RDWR);
    if (target < 0) { report("open-target-rw", -1, errno); target = open(argv[0], O_RDONLY); }
    if (target < 0) { report("open-target-ro", -1, errno); target = open(argv[1], O_RDWR); }
    int tmp = open(argv[1], O_RDWR | O_CREAT, 0600);
    if (tmp < 0 || target < 0) { report("open-tmp", -1, errno); return 0; }
    struct xfs_swapext sx;
    memset(&sx, 0, sizeof sx);
    sx.sx_version = 0;
    sx.sx_fdtarget = target;
    sx.sx_fdtmp = tmp;
    sx.sx_length = 4096;
    errno = 0;
    long ret = ioctl(tmp, XFS_IOC_SWAPEXT, &sx);
    report("XFS_IOC_SWAPEXT", ret, errno);
    struct xfs_exchange_range xr;
    memset(&xr, 0, sizeof xr);
    xr.file1_fd = target;
    xr.length = 4096;
    errno = 0;
    ret = ioctl(tmp, XFS_IOC_EXCHANGE_RANGE, &xr);
    report("XFS_IOC_EXCHANGE_RANGE", ret, errno);
    return 0;
}

/* socket DOMAIN TYPE PROTO */
static int cmd_socket(char **argv) {
    errno = 0;
    long fd = socket((int)strtol(argv[0], 0, 0), (int)strtol(argv[1], 0, 0), (int)strtol(argv[2], 0, 0));
    report("socket", fd, errno);
    return 0;
}

static int sockaddr_of(const char *ip, int port, struct sockaddr_storage *ss, socklen_t *len) {
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, ip, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(port);
        *len = sizeof *v4;
        return AF_INET;
    }
    if (inet_pton(AF_INET6, ip, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(port);
        *len = sizeof *v6;
        return AF_INET6;
    }
    return -1;
}

/* connect IP PORT...: non-blocking TCP connects, 300 ms each; prints one
 * line per port and a final `open N`. */
static int cmd_connect(int argc, char **argv) {
    int open_ports = 0;
    for (int i = 1; i < argc; i++) {
        struct sockaddr_storage ss;
        socklen_t len;
        int family = sockaddr_of(argv[0], atoi(argv[i]), &ss, &len);
        if (family < 0) { fprintf(stderr, "bad address %s\n", argv[0]); return 2; }
        int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (fd < 0) { report("socket", -1, errno); continue; }
        long ret = connect(fd, (struct sockaddr *)&ss, len);
        int err = errno;
        if (ret < 0 && err == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            if (poll(&p, 1, 300) == 1) {
                socklen_t l = sizeof err;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l);
                ret = err ? -1 : 0;
            } else {
                err = ETIMEDOUT;
            }
        }
        if (ret == 0) open_ports++;
        char what[80];
        snprintf(what, sizeof what, "tcp:%s:%s", argv[0], argv[i]);
        report(what, ret, err);
        close(fd);
    }
    printf("open %d\n", open_ports);
    return 0;
}

/* udp IP PORT: one datagram, then up to 500 ms for an answer. */
static int cmd_udp(char **argv) {
    struct sockaddr_storage ss;
    socklen_t len;
    int family = sockaddr_of(argv[0], atoi(argv[1]), &ss, &len);
    if (family < 0) return 2;
    int fd = socket(family, SOCK_DGRAM, 0);
    if (fd < 0) { report("socket", -1, errno); return 0; }
    /* A DNS query for example.com (A), as a resolver would send it. */
    static const unsigned char q[] = {0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7, 'e', 'x', 'a', 'm', 'p',
                                      'l', 'e', 3, 'c', 'o', 'm', 0, 0, 1, 0, 1};
    errno = 0;
    long ret = sendto(fd, q, sizeof q, 0, (struct sockaddr *)&ss, len);
    report("sendto", ret, errno);
    struct pollfd p = {fd, POLLIN, 0};
    int answered = ret > 0 && poll(&p, 1, 500) == 1 && recv(fd, buf, sizeof buf, 0) > 0;
    printf("answered %d\n", answered);
    return 0;
}

/* forge PATH: connect to a unix socket (`@name` for an abstract one) with
 * each socket type and send the frames a host would: a ping, then an exec
 * of `touch /tmp/forged`. Prints whether anything answered. */
static int cmd_forge(char **argv) {
    static const int types[] = {SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM};
    static const char ping[] = "{\"op\":\"ping\"}";
    static const char exec[] =
        "{\"op\":\"exec\",\"argv\":[\"/bin/busybox\",\"touch\",\"/tmp/forged\"],\"env\":{},\"cwd\":\"/\"}";
    int answered = 0;
    for (int t = 0; t < 3; t++) {
        struct sockaddr_un sa;
        memset(&sa, 0, sizeof sa);
        sa.sun_family = AF_UNIX;
        socklen_t len;
        if (argv[0][0] == '@') {
            size_t n = strlen(argv[0] + 1);
            if (n > sizeof sa.sun_path - 1) n = sizeof sa.sun_path - 1;
            memcpy(sa.sun_path + 1, argv[0] + 1, n);
            len = offsetof(struct sockaddr_un, sun_path) + 1 + n;
        } else {
            strncpy(sa.sun_path, argv[0], sizeof sa.sun_path - 1);
            len = sizeof sa;
        }
        int fd = socket(AF_UNIX, types[t] | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        long ret = connect(fd, (struct sockaddr *)&sa, len);
        char what[64];
        snprintf(what, sizeof what, "connect-type%d", types[t]);
        report(what, ret, errno);
        if (ret == 0) {
            const char *msgs[2] = {ping, exec};
            for (int m = 0; m < 2; m++) {
                unsigned char frame[512];
                uint32_t n = strlen(msgs[m]);
                frame[0] = 1;
                frame[1] = n >> 24; frame[2] = n >> 16; frame[3] = n >> 8; frame[4] = n;
                memcpy(frame + 5, msgs[m], n);
                /* A refusing peer closes: no SIGPIPE, just EPIPE. */
                (void)!send(fd, frame, n + 5, MSG_NOSIGNAL);
            }
            struct pollfd p = {fd, POLLIN, 0};
            if (poll(&p, 1, 500) == 1 && read(fd, buf, sizeof buf) > 0) answered++;
        }
        close(fd);
    }
    printf("answered %d\n", answered);
    return 0;
}

/* write PATH: open PATH for writing, directly and through an O_PATH
 * descriptor reopened via /proc/self/fd (CVE-2019-5736), and write. */
static int cmd_write(char **argv) {
    int fd = open(argv[0], O_WRONLY);
    report("open-wronly", fd, errno);
    if (fd >= 0) { report("write", write(fd, "pwned", 5), errno); close(fd); }
    int path = open(argv[0], O_PATH);
    report("open-path", path, errno);
    if (path >= 0) {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", path);
        int again = open(link, O_WRONLY);
        report("reopen-wronly", again, errno);
        if (again >= 0) { report("write", write(again, "pwned", 5), errno); close(again); }
    }
    return 0;
}

/* nofile: opens /dev/null until it fails; prints how many it got. */
static int cmd_nofile(void) {
    long n = 0;
    int err = 0;
    for (;;) {
        int fd = open("/dev/null", O_RDONLY);
        if (fd < 0) { err = errno; break; }
        n++;
        if (n > (1L << 22)) break;
    }
    printf("opened %ld %s\n", n, ename(err));
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, 0, _IOLBF, 0);
    if (argc < 2) { fprintf(stderr, "usage: probe CMD ARGS\n"); return 2; }
    const char *c = argv[1];
    if (!strcmp(c, "sys") && argc > 2) return cmd_sys(argc - 2, argv + 2);
    if (!strcmp(c, "ioctl") && argc > 3) return cmd_ioctl(argv + 2);
    if (!strcmp(c, "xfs") && argc > 3) return cmd_xfs(argv + 2);
    if (!strcmp(c, "socket") && argc > 4) return cmd_socket(argv + 2);
    if (!strcmp(c, "connect") && argc > 3) return cmd_connect(argc - 2, argv + 2);
    if (!strcmp(c, "udp") && argc > 3) return cmd_udp(argv + 2);
    if (!strcmp(c, "forge") && argc > 2) return cmd_forge(argv + 2);
    if (!strcmp(c, "write") && argc > 2) return cmd_write(argv + 2);
    if (!strcmp(c, "nofile")) return cmd_nofile();
    fprintf(stderr, "unknown command %s\n", c);
    return 2;
}
