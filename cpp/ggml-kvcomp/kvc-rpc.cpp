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
#include <vector>

namespace {

std::mutex                     g_mutex;
std::map<std::string, uint8_t> g_caps; // by endpoint, as the client's HELLO found it
std::set<std::string>          g_lost; // servers whose connection failed
std::set<ggml_backend_dev_t>   g_devs; // the devices of those servers the op-support rule asked about

// a device of ggml-rpc (its registry is "RPC"), described by its server's endpoint
bool rpc_endpoint(ggml_backend_dev_t dev, std::string & endpoint) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (!reg || strcmp(ggml_backend_reg_name(reg), "RPC") != 0) {
        return false;
    }
    endpoint = ggml_backend_dev_description(dev);
    return true;
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
        ggml_backend_dev_t dev = ggml_backend_get_device(backends[i]);
        cpu = cpu && dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU &&
              strcmp(ggml_backend_dev_name(dev), "CPU") == 0;
    }
    return (uint8_t) (GGML_TYPE_COUNT | (cpu ? GGML_KVCOMP_RPC_CPU_KERNELS : 0));
}

void ggml_kvcomp_rpc_set_caps(const char * endpoint, uint8_t caps) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_caps[endpoint] = caps;
}

int32_t ggml_kvcomp_rpc_dev_caps(ggml_backend_dev_t dev) {
    std::string endpoint;
    if (!rpc_endpoint(dev, endpoint)) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_devs.insert(dev);
    const auto it = g_caps.find(endpoint);
    return it == g_caps.end() ? 0 : it->second;
}

// the types a server knows, from its HELLO byte (0: a server that does not say, upstream's)
static int32_t n_types_of(int32_t caps) {
    const int32_t n = caps & (GGML_KVCOMP_RPC_CPU_KERNELS - 1);
    return n == 0 ? (int32_t) GGML_KVCOMP_TYPE_FIRST : n;
}

int32_t ggml_kvcomp_dev_n_types(ggml_backend_dev_t dev) {
    const int32_t caps = ggml_kvcomp_rpc_dev_caps(dev);
    return caps < 0 ? (int32_t) GGML_TYPE_COUNT : n_types_of(caps);
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
    bool known = (int32_t) t->type < n_types;
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        known = known && (!t->src[i] || (int32_t) t->src[i]->type < n_types);
    }
    return known;
}

bool ggml_kvcomp_dev_cpu_kernels(ggml_backend_dev_t dev) {
    if (!dev) {
        return false;
    }
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU && strcmp(ggml_backend_dev_name(dev), "CPU") == 0) {
        return true;
    }
    const int32_t caps = ggml_kvcomp_rpc_dev_caps(dev);
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

void ggml_kvcomp_rpc_lost(const char * endpoint, void * output, size_t output_size) {
    // the caller reads zeros rather than whatever its buffer held; the graph that needed
    // them fails at the next computation (ggml_kvcomp_rpc_any_lost)
    if (output) {
        memset(output, 0, output_size);
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_lost.insert(endpoint).second) {
        GGML_LOG_ERROR("RPC server %s: the connection is lost (the server stopped, crashed or closed it): every "
                       "computation that needs it fails from now on\n", endpoint);
    }
}

bool ggml_kvcomp_rpc_any_lost(void) {
    std::vector<ggml_backend_dev_t> devs;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (!g_lost.empty()) {
            return true;
        }
        devs.assign(g_devs.begin(), g_devs.end());
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
