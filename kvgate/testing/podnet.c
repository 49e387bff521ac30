/* The pod network of `make cluster`'s node, for programs that bind as if they had one (Envoy
 * as Envoy Gateway's proxy pods run it, and kvgate's own processes): loaded with LD_PRELOAD, it gives the process the network view
 * it would have inside a pod's own network namespace, on a machine that has none to give.
 *
 * - bind() to every address (0.0.0.0) or to 127.0.0.1 binds the pod's own loopback address
 *   (KVGATE_POD_IP, 127.10.x.y) instead: two proxies can both listen on :10080 and on their
 *   admin port 127.0.0.1:19000, and nothing listens beyond loopback.
 * - connect() to 127.0.0.1 or 0.0.0.0 goes to the pod's address: "localhost" inside a pod is
 *   the pod itself (an admin client, a sidecar), never the node.
 *
 * - an abstract Unix socket (Envoy's hot-restart channel) gets the pod's address appended to
 *   its name, as abstract sockets belong to a network namespace: two proxies on the default
 *   --base-id do not collide.
 *
 * Every other address, and every IPv6 one, is left as it is. Without KVGATE_POD_IP it does
 * nothing. Go programs make their own system calls and never see it.
 *
 * KVGATE_PODNET_BINDS_ONLY=1 (kvgate's own pods): binds and abstract sockets as above, connects
 * to 127.0.0.1 left alone: their processes reach the API server and a test's hub there, on the
 * node, as they do without the shim.
 *
 * Built by scripts/setup.sh:  cc -shared -fPIC -O2 -o .tools/lib/kvgate-podnet.so podnet.c -ldl
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

typedef int (*sock_fn)(int, const struct sockaddr *, socklen_t);

static int pod_address(struct in_addr *out) {
    const char *ip = getenv("KVGATE_POD_IP");
    return ip != NULL && inet_pton(AF_INET, ip, out) == 1;
}

union room {
    struct sockaddr_in in;
    struct sockaddr_un un;
};

/* An abstract socket's name with "@<pod ip>" appended, in `room`; `addr` when it does not fit.
 * A name passed with the whole sockaddr_un's length (Envoy's) is zero-padded: the pod's part
 * goes after its last non-zero byte, and the length stays. */
static const struct sockaddr *abstract_in_pod(const struct sockaddr *addr, socklen_t *len, union room *room) {
    const char *ip = getenv("KVGATE_POD_IP");
    size_t given = (size_t)*len - offsetof(struct sockaddr_un, sun_path);
    size_t name = given;
    size_t extra = ip == NULL ? 0 : strlen(ip) + 1;
    if (extra == 0 || given > sizeof(room->un.sun_path))
        return addr;
    memset(&room->un, 0, sizeof(room->un));
    memcpy(&room->un, addr, (size_t)*len);
    while (name > 1 && room->un.sun_path[name - 1] == '\0')
        name--;
    if (name + extra > sizeof(room->un.sun_path))
        return addr;
    room->un.sun_path[name] = '@';
    memcpy(room->un.sun_path + name + 1, ip, extra - 1);
    if (name + extra > given)
        *len += (socklen_t)(name + extra - given);
    return (const struct sockaddr *)&room->un;
}

/* The address to use instead of `addr`, in `room`; `addr` itself when nothing changes. */
static const struct sockaddr *in_pod(const struct sockaddr *addr, socklen_t *len, union room *room) {
    struct in_addr pod;
    if (addr != NULL && addr->sa_family == AF_UNIX && *len > (socklen_t)offsetof(struct sockaddr_un, sun_path) + 1 &&
        ((const struct sockaddr_un *)addr)->sun_path[0] == '\0')
        return abstract_in_pod(addr, len, room);
    if (addr == NULL || addr->sa_family != AF_INET || *len < (socklen_t)sizeof(struct sockaddr_in))
        return addr;
    const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
    uint32_t host = ntohl(in->sin_addr.s_addr);
    if (host != INADDR_ANY && host != INADDR_LOOPBACK)
        return addr;
    if (!pod_address(&pod))
        return addr;
    room->in = *in;
    room->in.sin_addr = pod;
    return (const struct sockaddr *)&room->in;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static sock_fn real;
    union room room;
    if (real == NULL)
        real = (sock_fn)dlsym(RTLD_NEXT, "bind");
    addr = in_pod(addr, &len, &room);
    return real(fd, addr, len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static sock_fn real;
    union room room;
    if (real == NULL)
        real = (sock_fn)dlsym(RTLD_NEXT, "connect");
    if (addr == NULL || addr->sa_family != AF_INET || getenv("KVGATE_PODNET_BINDS_ONLY") == NULL)
        addr = in_pod(addr, &len, &room);
    return real(fd, addr, len);
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr, socklen_t len) {
    static ssize_t (*real)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
    union room room;
    if (real == NULL)
        real = (ssize_t(*)(int, const void *, size_t, int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "sendto");
    if (addr != NULL && addr->sa_family == AF_UNIX)
        addr = in_pod(addr, &len, &room);
    return real(fd, buf, n, flags, addr, len);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    union room room;
    struct msghdr copy;
    if (real == NULL)
        real = (ssize_t(*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    if (msg != NULL && msg->msg_name != NULL && ((const struct sockaddr *)msg->msg_name)->sa_family == AF_UNIX) {
        socklen_t len = msg->msg_namelen;
        copy = *msg;
        copy.msg_name = (void *)in_pod((const struct sockaddr *)msg->msg_name, &len, &room);
        copy.msg_namelen = len;
        return real(fd, &copy, flags);
    }
    return real(fd, msg, flags);
}
