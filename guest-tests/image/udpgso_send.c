/* udpgso_send: send UDP datagrams in one sendmsg each, using the UDP_SEGMENT
 * socket option (Linux >= 4.18) so the kernel -- or the NIC, with USO -- cuts
 * them into gso_size-byte segments.
 *
 *   udpgso_send [-6] [-c COUNT] [-g GSO_SIZE] HOST PORT SIZE
 *
 * SIZE is the payload handed to one sendmsg; GSO_SIZE 0 disables UDP_SEGMENT
 * (plain datagram). Prints "sent N calls B bytes" on success; exit 1 on error. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

static void usage(void)
{
    fprintf(stderr, "usage: udpgso_send [-6] [-c COUNT] [-g GSO_SIZE] HOST PORT SIZE\n");
    exit(2);
}

int main(int argc, char **argv)
{
    int v6 = 0, opt;
    long count = 1, gso = 0;
    while ((opt = getopt(argc, argv, "6c:g:")) != -1) {
        switch (opt) {
        case '6': v6 = 1; break;
        case 'c': count = strtol(optarg, NULL, 0); break;
        case 'g': gso = strtol(optarg, NULL, 0); break;
        default: usage();
        }
    }
    if (argc - optind != 3)
        usage();
    const char *host = argv[optind];
    int port = atoi(argv[optind + 1]);
    long size = strtol(argv[optind + 2], NULL, 0);
    if (size < 0 || size > 65535 || port <= 0 || port > 65535 || gso < 0 || gso > 65535)
        usage();

    struct sockaddr_storage ss;
    socklen_t sl;
    memset(&ss, 0, sizeof ss);
    if (v6 || strchr(host, ':')) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(port);
        if (inet_pton(AF_INET6, host, &s6->sin6_addr) != 1) usage();
        sl = sizeof *s6;
    } else {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
        s4->sin_family = AF_INET;
        s4->sin_port = htons(port);
        if (inet_pton(AF_INET, host, &s4->sin_addr) != 1) usage();
        sl = sizeof *s4;
    }
    int fd = socket(ss.ss_family, SOCK_DGRAM, 0);
    if (fd < 0) { perror("socket"); return 1; }
    if (connect(fd, (struct sockaddr *)&ss, sl) < 0) { perror("connect"); return 1; }
    if (gso > 0) {
        int val = (int)gso;
        if (setsockopt(fd, SOL_UDP, UDP_SEGMENT, &val, sizeof val) < 0) {
            perror("setsockopt UDP_SEGMENT");
            return 1;
        }
    }
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf) { perror("malloc"); return 1; }
    long sent = 0, bytes = 0;
    for (long i = 0; i < count; i++) {
        for (long j = 0; j < size; j++)
            buf[j] = (unsigned char)(i + j);
        ssize_t n = send(fd, buf, size, 0);
        if (n < 0) {
            if (errno == ENOBUFS || errno == EAGAIN) { usleep(1000); i--; continue; }
            fprintf(stderr, "send %ld: %s\n", i, strerror(errno));
            printf("sent %ld calls %ld bytes\n", sent, bytes);
            return 1;
        }
        sent++;
        bytes += n;
    }
    printf("sent %ld calls %ld bytes\n", sent, bytes);
    return 0;
}
