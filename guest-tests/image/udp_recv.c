/* udp_recv: count UDP datagrams and bytes arriving on a port.
 *
 *   udp_recv [-6] [-t IDLE_SECONDS] [-n EXPECTED_DATAGRAMS] PORT
 *
 * Stops after IDLE_SECONDS (default 2) without a datagram, or once
 * EXPECTED_DATAGRAMS have arrived. Prints "datagrams N bytes B min M max X". */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int v6 = 0, opt, idle = 2;
    long expect = 0;
    while ((opt = getopt(argc, argv, "6t:n:")) != -1) {
        switch (opt) {
        case '6': v6 = 1; break;
        case 't': idle = atoi(optarg); break;
        case 'n': expect = strtol(optarg, NULL, 0); break;
        default: goto usage;
        }
    }
    if (argc - optind != 1) {
usage:
        fprintf(stderr, "usage: udp_recv [-6] [-t IDLE] [-n EXPECTED] PORT\n");
        return 2;
    }
    int port = atoi(argv[optind]);
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_DGRAM, 0);
    if (fd < 0) { perror("socket"); return 1; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rcvbuf = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    socklen_t sl;
    if (v6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(port);
        s6->sin6_addr = in6addr_any;
        sl = sizeof *s6;
    } else {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
        s4->sin_family = AF_INET;
        s4->sin_port = htons(port);
        s4->sin_addr.s_addr = htonl(INADDR_ANY);
        sl = sizeof *s4;
    }
    if (bind(fd, (struct sockaddr *)&ss, sl) < 0) { perror("bind"); return 1; }
    printf("listening %d\n", port);
    fflush(stdout);
    struct timeval tv = { .tv_sec = idle, .tv_usec = 0 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    static unsigned char buf[65536];
    long n = 0, bytes = 0, mn = -1, mx = 0;
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0)
            break;
        n++;
        bytes += r;
        if (mn < 0 || r < mn) mn = r;
        if (r > mx) mx = r;
        if (expect && n >= expect)
            break;
    }
    printf("datagrams %ld bytes %ld min %ld max %ld\n", n, bytes, mn < 0 ? 0 : mn, mx);
    return 0;
}
