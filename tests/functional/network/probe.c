/* The network tests' probe: uploaded into an `allowlist` sandbox, it makes
 * the socket calls a busybox shell cannot and prints one line per attempt,
 * `<what> <OK|errno name>`, so a test can tell an egress refusal (EPERM)
 * from an unreachable peer. It only talks to the addresses it is given,
 * which the tests own (servers in network namespaces they made). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>

static const char *ename(int e) {
    switch (e) {
    case 0: return "OK";
    case EPERM: return "EPERM";
    case EACCES: return "EACCES";
    case ECONNREFUSED: return "ECONNREFUSED";
    case ENETUNREACH: return "ENETUNREACH";
    case EHOSTUNREACH: return "EHOSTUNREACH";
    case ETIMEDOUT: return "ETIMEDOUT";
    case EAGAIN: return "EAGAIN";
    case EAFNOSUPPORT: return "EAFNOSUPPORT";
    case EPROTONOSUPPORT: return "EPROTONOSUPPORT";
    case ECONNRESET: return "ECONNRESET";
    case EPIPE: return "EPIPE";
    default: return "EOTHER";
    }
}

static int tcp4(const char *ip, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, ip, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Sends one byte and waits (bounded) for the echo. */
static int round_trip(int fd, char c) {
    struct timeval tv = {.tv_sec = 3};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (write(fd, &c, 1) != 1) return -1;
    char got;
    ssize_t n = read(fd, &got, 1);
    if (n == 1 && got == c) return 0;
    if (n == 0) errno = ECONNRESET;
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *cmd = argv[1];
    if (!strcmp(cmd, "tcp") && argc == 4) {
        int fd = tcp4(argv[2], atoi(argv[3]));
        printf("tcp %s\n", ename(fd < 0 ? errno : 0));
        if (fd >= 0) printf("echo %s\n", ename(round_trip(fd, 'x') < 0 ? errno : 0));
    } else if (!strcmp(cmd, "udp") && argc == 4) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[3]))};
        inet_pton(AF_INET, argv[2], &a.sin_addr);
        int fd = socket(AF_INET, SOCK_DGRAM, 0);
        int r = sendto(fd, "q", 1, 0, (struct sockaddr *)&a, sizeof a);
        printf("udp %s\n", ename(r < 0 ? errno : 0));
    } else if (!strcmp(cmd, "tcp6") && argc == 4) {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(argv[3]))};
        inet_pton(AF_INET6, argv[2], &a.sin6_addr);
        int fd = socket(AF_INET6, SOCK_STREAM, 0);
        struct timeval tv = {.tv_sec = 5};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        int r = connect(fd, (struct sockaddr *)&a, sizeof a);
        printf("tcp6 %s\n", ename(r < 0 ? errno : 0));
        if (r == 0) printf("echo %s\n", ename(round_trip(fd, 'x') < 0 ? errno : 0));
    } else if (!strcmp(cmd, "udp6") && argc == 4) {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(argv[3]))};
        inet_pton(AF_INET6, argv[2], &a.sin6_addr);
        int fd = socket(AF_INET6, SOCK_DGRAM, 0);
        int r = sendto(fd, "q", 1, 0, (struct sockaddr *)&a, sizeof a);
        printf("udp6 %s\n", ename(r < 0 ? errno : 0));
    } else if (!strcmp(cmd, "sockets")) {
        int raw = socket(AF_INET, SOCK_RAW, IPPROTO_ICMP);
        printf("raw %s\n", ename(raw < 0 ? errno : 0));
        int packet = socket(AF_PACKET, SOCK_RAW, htons(3));
        printf("packet %s\n", ename(packet < 0 ? errno : 0));
        int icmp = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
        printf("icmp %s\n", ename(icmp < 0 ? errno : 0));
        int sctp = socket(AF_INET, SOCK_STREAM, 132);
        printf("sctp %s\n", ename(sctp < 0 ? errno : 0));
    } else if (!strcmp(cmd, "hold") && argc == 5) {
        /* Connects, proves the connection works, then waits for the file
         * argv[4] to appear and tries once more on the same connection. */
        int fd = tcp4(argv[2], atoi(argv[3]));
        printf("tcp %s\n", ename(fd < 0 ? errno : 0));
        if (fd < 0) return 0;
        printf("first %s\n", ename(round_trip(fd, 'a') < 0 ? errno : 0));
        fflush(stdout);
        struct stat st;
        for (int i = 0; i < 6000 && stat(argv[4], &st) < 0; i++) usleep(10000);
        printf("second %s\n", ename(round_trip(fd, 'b') < 0 ? errno : 0));
    } else {
        return 2;
    }
    return 0;
}
