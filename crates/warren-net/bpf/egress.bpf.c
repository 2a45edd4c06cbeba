// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
//
// Warren's egress programs: one set per node, attached to the cgroup2
// directory of every sandbox in `allowlist` network mode. The policy map is
// keyed by (sandbox cgroup id, destination prefix), so a create or a policy
// change costs map updates and attaches, never a program load.
//
// Verdicts: 1 lets the operation through, 0 refuses it (connect/sendmsg and
// socket() fail with EPERM, a packet is dropped). Every refusal is sent to
// the `denials` ring buffer for the node to turn into a security event.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define AF_UNIX 1
#define AF_INET 2
#define AF_INET6 10
#define SOCK_STREAM 1
#define SOCK_DGRAM 2

// Keep in step with src/bpf.rs.
#define MAX_PORTS 32

#define HOOK_CONNECT 1
#define HOOK_SENDMSG 2
#define HOOK_SOCK_CREATE 3
#define HOOK_EGRESS 4

// LPM key: prefixlen counts the 64 bits of the cgroup id (always matched in
// full) plus the prefix of the address, which is IPv6 or IPv4-mapped IPv6.
struct policy_key {
	__u32 prefixlen;
	__u8 data[24];
};

// What one destination prefix allows; ports in host byte order. The node
// merges every covering prefix's ports into each entry, so the longest match
// alone decides.
struct policy_value {
	__u8 tcp_any;
	__u8 udp_any;
	__u8 n_tcp;
	__u8 n_udp;
	__u16 tcp[MAX_PORTS];
	__u16 udp[MAX_PORTS];
};

struct denial {
	__u64 cgroup;
	__u32 pid;
	__u16 port;
	__u8 family;
	__u8 protocol;
	__u8 hook;
	__u8 sock_type;
	__u8 pad[2];
	__u8 addr[16];
	char comm[16];
	// The pid as seen inside the sandbox (0 if unknown).
	__u32 ns_pid;
};

// The sandbox's pid namespace (nsfs device and inode), so a denial can name
// the process as the sandbox sees it.
struct pidns {
	__u64 dev;
	__u64 ino;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct policy_key);
	__type(value, struct policy_value);
} warren_policy SEC(".maps");

// Entry 0: the cgroup2 level of the sandboxes' directories, so processes in
// sub-cgroups are judged by their sandbox's policy.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} warren_settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, struct pidns);
} warren_pidns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} warren_denials SEC(".maps");

static __always_inline int sandbox_level(void)
{
	__u32 zero = 0;
	__u32 *level = bpf_map_lookup_elem(&warren_settings, &zero);
	return level ? (int)*level : 2;
}

static __always_inline void map_v4(__u32 ip4_be, __u8 addr[16])
{
	__builtin_memset(addr, 0, 16);
	addr[10] = 0xff;
	addr[11] = 0xff;
	__builtin_memcpy(addr + 12, &ip4_be, 4);
}

static __always_inline int is_loopback(const __u8 addr[16])
{
	int i;
	int mapped = addr[10] == 0xff && addr[11] == 0xff;
	for (i = 0; i < 10; i++)
		if (addr[i])
			return 0;
	if (mapped)
		return addr[12] == 127;
	if (addr[10] || addr[11] || addr[12] || addr[13] || addr[14])
		return 0;
	return addr[15] == 1;
}

static __always_inline int ports_allow(__u8 any, __u8 n, const __u16 *ports, __u16 port)
{
	int i;
	if (any)
		return 1;
	for (i = 0; i < MAX_PORTS; i++) {
		if (i >= n)
			break;
		if (ports[i] == port)
			return 1;
	}
	return 0;
}

// port 0 means "unknown" (a non-first fragment): any rule for the protocol lets it pass.
static __always_inline int allowed(__u64 cgroup, const __u8 addr[16], __u8 protocol, __u16 port)
{
	struct policy_key key = {.prefixlen = 64 + 128};
	struct policy_value *v;

	if (is_loopback(addr))
		return 1;
	__builtin_memcpy(key.data, &cgroup, 8);
	__builtin_memcpy(key.data + 8, addr, 16);
	v = bpf_map_lookup_elem(&warren_policy, &key);
	if (!v)
		return 0;
	if (protocol == IPPROTO_TCP)
		return port == 0 ? (v->tcp_any || v->n_tcp) : ports_allow(v->tcp_any, v->n_tcp, v->tcp, port);
	if (protocol == IPPROTO_UDP)
		return port == 0 ? (v->udp_any || v->n_udp) : ports_allow(v->udp_any, v->n_udp, v->udp, port);
	return 0;
}

static __always_inline void report(__u64 cgroup, __u8 hook, __u8 family, __u8 protocol, __u8 sock_type,
				   const __u8 addr[16], __u16 port, int with_task)
{
	struct denial *d = bpf_ringbuf_reserve(&warren_denials, sizeof(*d), 0);
	if (!d)
		return;
	__builtin_memset(d, 0, sizeof(*d));
	d->cgroup = cgroup;
	d->hook = hook;
	d->family = family;
	d->protocol = protocol;
	d->sock_type = sock_type;
	d->port = port;
	if (addr)
		__builtin_memcpy(d->addr, addr, 16);
	if (with_task) {
		struct pidns *ns = bpf_map_lookup_elem(&warren_pidns, &cgroup);
		d->pid = bpf_get_current_pid_tgid() >> 32;
		bpf_get_current_comm(d->comm, sizeof(d->comm));
		if (ns) {
			struct bpf_pidns_info info = {};
			if (!bpf_get_ns_current_pid_tgid(ns->dev, ns->ino, &info, sizeof(info)))
				d->ns_pid = info.tgid;
		}
	}
	bpf_ringbuf_submit(d, 0);
}

static __always_inline int sock_addr_verdict(struct bpf_sock_addr *ctx, const __u8 addr[16], __u8 family, __u8 hook)
{
	__u64 cgroup = bpf_get_current_ancestor_cgroup_id(sandbox_level());
	__u16 port = bpf_ntohs((__u16)ctx->user_port);
	__u8 protocol = ctx->protocol;
	if (protocol == 0)
		protocol = ctx->type == SOCK_STREAM ? IPPROTO_TCP : IPPROTO_UDP;
	if (allowed(cgroup, addr, protocol, port))
		return 1;
	report(cgroup, hook, family, protocol, ctx->type, addr, port, 1);
	return 0;
}

SEC("cgroup/connect4")
int warren_connect4(struct bpf_sock_addr *ctx)
{
	__u8 addr[16];
	map_v4(ctx->user_ip4, addr);
	return sock_addr_verdict(ctx, addr, AF_INET, HOOK_CONNECT);
}

SEC("cgroup/sendmsg4")
int warren_sendmsg4(struct bpf_sock_addr *ctx)
{
	__u8 addr[16];
	map_v4(ctx->user_ip4, addr);
	return sock_addr_verdict(ctx, addr, AF_INET, HOOK_SENDMSG);
}

static __always_inline void copy_ip6(struct bpf_sock_addr *ctx, __u8 addr[16])
{
	__u32 w0 = ctx->user_ip6[0], w1 = ctx->user_ip6[1], w2 = ctx->user_ip6[2], w3 = ctx->user_ip6[3];
	__builtin_memcpy(addr, &w0, 4);
	__builtin_memcpy(addr + 4, &w1, 4);
	__builtin_memcpy(addr + 8, &w2, 4);
	__builtin_memcpy(addr + 12, &w3, 4);
}

SEC("cgroup/connect6")
int warren_connect6(struct bpf_sock_addr *ctx)
{
	__u8 addr[16];
	copy_ip6(ctx, addr);
	return sock_addr_verdict(ctx, addr, AF_INET6, HOOK_CONNECT);
}

SEC("cgroup/sendmsg6")
int warren_sendmsg6(struct bpf_sock_addr *ctx)
{
	__u8 addr[16];
	copy_ip6(ctx, addr);
	return sock_addr_verdict(ctx, addr, AF_INET6, HOOK_SENDMSG);
}

// Runs for every inet/inet6 socket made in the sandbox: only TCP and UDP
// stream/datagram sockets (no raw sockets, no ICMP datagram sockets, no SCTP).
SEC("cgroup/sock_create")
int warren_sock_create(struct bpf_sock *sk)
{
	__u32 type = sk->type, protocol = sk->protocol;
	int ok = (type == SOCK_STREAM && (protocol == 0 || protocol == IPPROTO_TCP)) ||
		 (type == SOCK_DGRAM && (protocol == 0 || protocol == IPPROTO_UDP));
	if (ok)
		return 1;
	report(bpf_get_current_ancestor_cgroup_id(sandbox_level()), HOOK_SOCK_CREATE, sk->family, protocol, type,
	       0, 0, 1);
	return 0;
}

// The backstop: a packet to a destination the policy does not allow (now)
// is dropped, whatever socket it comes from - e.g. one connected before its
// rule was removed.
SEC("cgroup_skb/egress")
int warren_egress(struct __sk_buff *skb)
{
	__u64 cgroup = bpf_skb_ancestor_cgroup_id(skb, sandbox_level());
	__u8 addr[16];
	__u8 protocol = 0;
	__u16 port = 0;
	__u8 family;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr iph;
		if (bpf_skb_load_bytes(skb, 0, &iph, sizeof(iph)))
			return 0;
		map_v4(iph.daddr, addr);
		protocol = iph.protocol;
		family = AF_INET;
		if (!(iph.frag_off & bpf_htons(0x1fff))) {
			__u16 dport;
			if (!bpf_skb_load_bytes(skb, iph.ihl * 4 + 2, &dport, 2))
				port = bpf_ntohs(dport);
		}
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;
		__u16 dport;
		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
			return 0;
		__builtin_memcpy(addr, &ip6.daddr, 16);
		protocol = ip6.nexthdr;
		family = AF_INET6;
		// The kernel's own link traffic: MLD and anything else to
		// link-scope multicast (ff02::/16) never leaves the veth, and
		// neighbour discovery (hop limit 255) is what makes the gateway
		// reachable at all. No sandbox socket can send these: raw and
		// ICMP sockets are refused at socket(), and UDP to ff02:: at
		// sendmsg().
		if (addr[0] == 0xff && addr[1] == 0x02)
			return 1;
		if (protocol == IPPROTO_ICMPV6 && ip6.hop_limit == 255) {
			__u8 type;
			if (!bpf_skb_load_bytes(skb, sizeof(ip6), &type, 1) && (type == 135 || type == 136))
				return 1;
		}
		if (!bpf_skb_load_bytes(skb, sizeof(ip6) + 2, &dport, 2))
			port = bpf_ntohs(dport);
	} else {
		return 0;
	}
	if (allowed(cgroup, addr, protocol, port))
		return 1;
	report(cgroup, HOOK_EGRESS, family, protocol, 0, addr, port, 0);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
