/* Abstract unix sockets for tests/functional/phases.rs (built with
 * `gcc -static`, uploaded into the sandbox; busybox has no tool for them).
 *   abstract listen NAME   - bind @NAME, print "listening", accept forever
 *   abstract connect NAME  - print "connected" or "error: <strerror>", exit 0/1 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: abstract listen|connect NAME\n");
        return 2;
    }
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    size_t len = strlen(argv[2]);
    if (len + 1 > sizeof addr.sun_path) return 2;
    memcpy(addr.sun_path + 1, argv[2], len);
    socklen_t addr_len = offsetof(struct sockaddr_un, sun_path) + 1 + len;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) { printf("error: %s\n", strerror(errno)); return 1; }
    if (strcmp(argv[1], "listen") == 0) {
        if (bind(fd, (struct sockaddr *)&addr, addr_len) < 0 || listen(fd, 8) < 0) {
            printf("error: %s\n", strerror(errno));
            return 1;
        }
        printf("listening\n");
        fflush(stdout);
        for (;;) {
            int c = accept(fd, NULL, NULL);
            if (c >= 0) close(c);
        }
    }
    if (connect(fd, (struct sockaddr *)&addr, addr_len) < 0) {
        printf("error: %s\n", strerror(errno));
        return 1;
    }
    printf("connected\n");
    return 0;
}
