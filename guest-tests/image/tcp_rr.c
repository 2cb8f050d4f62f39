/* tcp_rr: request/response latency, one byte each way over one TCP connection.
 *
 *   tcp_rr -s PORT                 serve: echo every byte back (one client at a time)
 *   tcp_rr -c ADDR -p PORT [-n N]  measure N round trips (default 2000, after 100 of
 *                                  warm-up); prints "rr N p50_us X p90_us Y p99_us Z"
 *
 * TCP_NODELAY on both ends; ADDR is a numeric IPv4 or IPv6 address (no resolver, so
 * the static binary needs nothing from the system). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int serve(const char *port)
{
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_ANY_INIT,
                              .sin6_port = htons(atoi(port))};
    int s = socket(AF_INET6, SOCK_STREAM, 0), one = 1, zero = 0;
    if (s < 0 || setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero)
        || setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one)
        || bind(s, (struct sockaddr *)&sa, sizeof sa) || listen(s, 4)) {
        perror("tcp_rr: listen");
        return 1;
    }
    for (;;) {
        int c = accept(s, NULL, NULL);
        char b;
        if (c < 0)
            continue;
        nodelay(c);
        while (read(c, &b, 1) == 1 && write(c, &b, 1) == 1)
            ;
        close(c);
    }
}

static int client(const char *addr, const char *port, long n)
{
    struct sockaddr_in v4 = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
    struct sockaddr_in6 v6 = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(port))};
    const long warm = 100;
    double *rtt = calloc(n, sizeof *rtt);
    int s = -1;
    if (!rtt)
        return 1;
    if (inet_pton(AF_INET, addr, &v4.sin_addr) == 1) {
        s = socket(AF_INET, SOCK_STREAM, 0);
        if (s >= 0 && connect(s, (struct sockaddr *)&v4, sizeof v4))
            s = -1;
    } else if (inet_pton(AF_INET6, addr, &v6.sin6_addr) == 1) {
        s = socket(AF_INET6, SOCK_STREAM, 0);
        if (s >= 0 && connect(s, (struct sockaddr *)&v6, sizeof v6))
            s = -1;
    } else {
        fprintf(stderr, "tcp_rr: %s is not a numeric address\n", addr);
        return 2;
    }
    if (s < 0) {
        perror("tcp_rr: connect");
        return 1;
    }
    nodelay(s);
    for (long i = -warm; i < n; i++) {
        char b = 'x';
        double t0 = now_us();
        if (write(s, &b, 1) != 1 || read(s, &b, 1) != 1) {
            fprintf(stderr, "tcp_rr: connection lost after %ld round trips\n", i + warm);
            return 1;
        }
        if (i >= 0)
            rtt[i] = now_us() - t0;
    }
    qsort(rtt, n, sizeof *rtt, cmp);
    printf("rr %ld p50_us %.1f p90_us %.1f p99_us %.1f\n", n, rtt[n / 2], rtt[n * 9 / 10],
           rtt[n * 99 / 100]);
    close(s);
    return 0;
}

int main(int argc, char **argv)
{
    const char *srv = NULL, *addr = NULL, *port = NULL;
    long n = 2000;
    int opt;
    while ((opt = getopt(argc, argv, "s:c:p:n:")) != -1) {
        switch (opt) {
        case 's': srv = optarg; break;
        case 'c': addr = optarg; break;
        case 'p': port = optarg; break;
        case 'n': n = strtol(optarg, NULL, 0); break;
        default: goto usage;
        }
    }
    if (srv)
        return serve(srv);
    if (addr && port && n > 0)
        return client(addr, port, n);
usage:
    fprintf(stderr, "usage: tcp_rr -s PORT | tcp_rr -c ADDR -p PORT [-n ROUND_TRIPS]\n");
    return 2;
}
