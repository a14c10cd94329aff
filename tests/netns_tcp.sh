#!/bin/bash
# Two ranks in two network namespaces joined by a veth pair talk over TCP: the bootstrap, the mesh
# and the transport all cross a real (virtual) link instead of loopback.
# Needs root and iproute2; exits 77 (skipped) with the reason otherwise.
set -u
bin=$1
if [ "$(id -u)" != 0 ]; then echo "skipped: creating network namespaces needs root"; exit 77; fi
if ! command -v ip >/dev/null; then echo "skipped: iproute2 (ip) is not installed"; exit 77; fi
a=tuttiA$$ b=tuttiB$$
cleanup() { ip netns del $a 2>/dev/null; ip netns del $b 2>/dev/null; }
trap cleanup EXIT
if ! ip netns add $a 2>/dev/null || ! ip netns add $b 2>/dev/null; then
  echo "skipped: this kernel or sandbox does not allow network namespaces"; exit 77
fi
set -e
ip link add vethA$$ netns $a type veth peer name vethB$$ netns $b
ip -n $a addr add 10.213.0.1/24 dev vethA$$
ip -n $b addr add 10.213.0.2/24 dev vethB$$
ip -n $a link set vethA$$ up; ip -n $a link set lo up
ip -n $b link set vethB$$ up; ip -n $b link set lo up
set +e
common="TUTTI_SIZE=2 TUTTI_COMM_SECRET=netns NCCL_COMM_ID=10.213.0.1:29517 TUTTI_TRANSPORT=tcp TUTTI_INIT_TIMEOUT=60"
ip netns exec $a env $common TUTTI_RANK=0 NCCL_SOCKET_IFNAME=vethA $bin exchange 8388608 > /tmp/netns-$$-0.log 2>&1 &
p0=$!
ip netns exec $b env $common TUTTI_RANK=1 NCCL_SOCKET_IFNAME=vethB $bin exchange 8388608 > /tmp/netns-$$-1.log 2>&1 &
p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
cat /tmp/netns-$$-0.log /tmp/netns-$$-1.log; rm -f /tmp/netns-$$-*.log
if [ $s0 != 0 ] || [ $s1 != 0 ]; then echo "netns TCP exchange failed: rank 0 status $s0, rank 1 status $s1"; exit 1; fi
echo "netns TCP exchange ok"
# Two hosts: rank 1 in an IPC namespace of its own shares no memory with rank 0 (another host hash),
# so the world topology merged through the bootstrap has two hosts joined over the network.
if ! unshare --ipc true 2>/dev/null; then echo "skipped the two-host topology: unshare --ipc is not allowed"; exit 0; fi
common="TUTTI_SIZE=2 TUTTI_COMM_SECRET=netns NCCL_COMM_ID=10.213.0.1:29518 TUTTI_INIT_TIMEOUT=60"
ip netns exec $a env $common TUTTI_RANK=0 NCCL_SOCKET_IFNAME=vethA $bin world 2 > /tmp/netns-$$-0.log 2>&1 &
p0=$!
ip netns exec $b unshare --ipc env $common TUTTI_RANK=1 NCCL_SOCKET_IFNAME=vethB $bin world 2 > /tmp/netns-$$-1.log 2>&1 &
p1=$!
wait $p0; s0=$?
wait $p1; s1=$?
cat /tmp/netns-$$-0.log /tmp/netns-$$-1.log; rm -f /tmp/netns-$$-*.log
if [ $s0 = 0 ] && [ $s1 = 0 ]; then echo "two-host world topology ok"; exit 0; fi
echo "two-host world topology failed: rank 0 status $s0, rank 1 status $s1"; exit 1
