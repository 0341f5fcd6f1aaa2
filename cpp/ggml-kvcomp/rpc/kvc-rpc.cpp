// kvcomp over ggml-rpc (docs/distributed.md): what a server tells its clients about itself,
// what a client makes of it, and a server that goes away. ggml-rpc calls the setters
// (patches 0020, 0021); the op-support rule and libllama read the rest.
//
// A server from this build puts, in the byte of its HELLO reply that upstream leaves 0, the
// number of ggml types it knows (bits 0-6) and GGML_KVCOMP_RPC_CPU_KERNELS when every device
// it serves is the CPU backend, whose kernels read the residual buffer's exact rows and the
// kvct plans. An upstream server, or one of an older build, says 0: it knows upstream's types
// only, and a kvc tensor sent to it would close the connection (and abort the client).

#include "ggml-kvcomp.h"
#include "ggml-backend.h"
#include "ggml-impl.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef _WIN32
#    define WIN32_LEAN_AND_MEAN
#    include <winsock2.h>
typedef SOCKET socket_fd;
#else
#    include <sys/socket.h>
#    include <sys/time.h>
typedef int socket_fd;
#endif

namespace {

std::mutex                                     g_mutex;
std::map<std::string, uint8_t>                 g_caps;        // by endpoint, as the client's HELLO found it
std::unordered_map<ggml_backend_dev_t, int32_t> g_dev_caps;   // the same by device, for the op-support rule
std::set<std::string>                          g_lost;        // servers whose connection failed
std::set<std::string>                          g_unreachable; // servers that could not be reached

bool is_rpc_dev(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    return reg && strcmp(ggml_backend_reg_name(reg), "RPC") == 0;
}

// the CPU backend itself: kvcomp's CPU kernels are its kernels (other devices of type CPU,
// such as accelerators that register as one, run their own)
bool is_cpu_backend_dev(ggml_backend_dev_t dev) {
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU && strcmp(ggml_backend_dev_name(dev), "CPU") == 0;
}

// the types a server knows, from its HELLO byte (0: a server that does not say, upstream's)
int32_t n_types_of(int32_t caps) {
    const int32_t n = caps & (GGML_KVCOMP_RPC_CPU_KERNELS - 1);
    return n == 0 ? (int32_t) GGML_KVCOMP_TYPE_FIRST : n;
}

bool types_below(const ggml_tensor * t, int32_t n_types) {
    bool below = (int32_t) t->type < n_types;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        below = below && (!t->src[i] || (int32_t) t->src[i]->type < n_types);
    }
    return below;
}

int32_t parse_rpc_timeout_s() {
    const char * v = getenv("GGML_KVCOMP_RPC_TIMEOUT");
    if (!v) {
        return GGML_KVCOMP_RPC_TIMEOUT_DEFAULT;
    }
    char * end = nullptr;
    const long s = strtol(v, &end, 10);
    if (end == v || *end != '\0' || s < 0 || s > 86400) {
        GGML_LOG_ERROR("GGML_KVCOMP_RPC_TIMEOUT=%s is not a number of seconds from 0 (no limit) to 86400: using %d\n",
                       v, GGML_KVCOMP_RPC_TIMEOUT_DEFAULT);
        return GGML_KVCOMP_RPC_TIMEOUT_DEFAULT;
    }
    return (int32_t) s;
}

int32_t rpc_timeout_s() {
    static const int32_t s = parse_rpc_timeout_s();
    return s;
}

} // namespace

uint8_t ggml_kvcomp_rpc_server_caps(ggml_backend_t * backends, size_t n) {
    // lets a test play a server of another build without building one
    if (const char * v = getenv("GGML_KVCOMP_RPC_CAPS")) {
        return (uint8_t) strtoul(v, nullptr, 0);
    }
    static_assert(GGML_TYPE_COUNT < GGML_KVCOMP_RPC_CPU_KERNELS, "the type count must fit in 7 bits");
    bool cpu = n > 0;
    for (size_t i = 0; i < n; ++i) {
        cpu = cpu && is_cpu_backend_dev(ggml_backend_get_device(backends[i]));
    }
    return (uint8_t) (GGML_TYPE_COUNT | (cpu ? GGML_KVCOMP_RPC_CPU_KERNELS : 0));
}

void ggml_kvcomp_rpc_set_caps(const char * endpoint, uint8_t caps) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_caps[endpoint] = caps;
    g_unreachable.erase(endpoint);
    // a server reached again may be another build: its devices are looked up anew
    for (auto & dc : g_dev_caps) {
        if (strcmp(ggml_backend_dev_description(dc.first), endpoint) == 0) {
            dc.second = caps;
        }
    }
}

// what the server of an ggml-rpc device said (0: nothing, as upstream's); -1 for any other device
static int32_t rpc_dev_caps(ggml_backend_dev_t dev) {
    if (!is_rpc_dev(dev)) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto hit = g_dev_caps.find(dev);
    if (hit != g_dev_caps.end()) {
        return hit->second;
    }
    // an ggml-rpc device is described by its server's endpoint
    const auto it = g_caps.find(ggml_backend_dev_description(dev));
    const int32_t caps = it == g_caps.end() ? 0 : it->second;
    g_dev_caps.emplace(dev, caps);
    return caps;
}

bool ggml_kvcomp_dev_knows(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    const int32_t caps = rpc_dev_caps(dev);
    return caps < 0 || types_below(t, n_types_of(caps));
}

bool ggml_kvcomp_dev_knows_type(ggml_backend_dev_t dev, enum ggml_type type) {
    const int32_t caps = rpc_dev_caps(dev);
    return caps < 0 || (int32_t) type < n_types_of(caps);
}

bool ggml_kvcomp_rpc_knows(const char * endpoint, const struct ggml_tensor * t) {
    int32_t n_types = GGML_TYPE_COUNT;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        const auto it = g_caps.find(endpoint);
        if (it != g_caps.end()) {
            n_types = n_types_of(it->second);
        }
    }
    return types_below(t, n_types);
}

bool ggml_kvcomp_dev_cpu_kernels(ggml_backend_dev_t dev) {
    if (is_cpu_backend_dev(dev)) {
        return true;
    }
    const int32_t caps = rpc_dev_caps(dev);
    return caps > 0 && (caps & GGML_KVCOMP_RPC_CPU_KERNELS) != 0;
}

bool ggml_kvcomp_buffer_cpu_kernels(ggml_backend_buffer_t buf) {
    if (!buf) {
        return false;
    }
    if (ggml_backend_buffer_is_host(buf)) {
        return true;
    }
    return ggml_kvcomp_dev_cpu_kernels(ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf)));
}

void ggml_kvcomp_rpc_client_socket(uintptr_t fd) {
    const int32_t timeout_s = rpc_timeout_s();
    if (timeout_s == 0) {
        return;
    }
#ifdef _WIN32
    const DWORD tv = (DWORD) timeout_s * 1000;
#else
    struct timeval tv = {};
    tv.tv_sec = timeout_s;
#endif
    // a reply waits behind the graph the server is computing, so the limit bounds a graph too
    if (setsockopt((socket_fd) fd, SOL_SOCKET, SO_RCVTIMEO, (const char *) &tv, sizeof(tv)) != 0 ||
        setsockopt((socket_fd) fd, SOL_SOCKET, SO_SNDTIMEO, (const char *) &tv, sizeof(tv)) != 0) {
        GGML_LOG_WARN("RPC: could not set a %d s limit on the connection's replies: a server that stops answering "
                      "will hang this process\n", timeout_s);
    }
}

void ggml_kvcomp_rpc_unreachable(const char * endpoint) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_unreachable.insert(endpoint).second) {
        GGML_LOG_ERROR("RPC server %s: cannot connect, or it did not answer the HELLO (no server listens there, it is "
                       "not a ggml-rpc-server, its protocol differs, or it did not answer within %d s)\n",
                       endpoint, rpc_timeout_s());
    }
}

void ggml_kvcomp_rpc_lost(const char * endpoint, void * output, size_t output_size) {
    // the caller reads zeros rather than whatever its buffer held; the graph that needed
    // them fails at the next computation (ggml_kvcomp_rpc_any_lost)
    if (output) {
        memset(output, 0, output_size);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_unreachable.count(endpoint)) {
        return; // never connected: it has no devices, and nothing computes on it
    }
    if (g_lost.insert(endpoint).second) {
        GGML_LOG_ERROR("RPC server %s: the connection is lost (the server stopped, crashed, closed it, or did not "
                       "answer within GGML_KVCOMP_RPC_TIMEOUT = %d s): every computation that needs it fails from now "
                       "on\n", endpoint, rpc_timeout_s());
    }
}

bool ggml_kvcomp_rpc_any_lost(void) {
    std::vector<ggml_backend_dev_t> devs;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!g_lost.empty()) {
            return true;
        }
        for (const auto & dc : g_dev_caps) {
            devs.push_back(dc.first);
        }
    }
    // A graph is sent to a server without waiting for a reply, so a server that dies while
    // computing it is only noticed at the next command that reads one. Each server answers
    // commands in order, so one small request to each (its memory) returns once the graph
    // has run there, or finds the connection gone.
    for (ggml_backend_dev_t dev : devs) {
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    return !g_lost.empty();
}
