#!/usr/bin/env bash
# `ray up` for real on this machine, end to end, then `ray down`; exit 0 only when all held.
#
#   sudo bash scripts/cluster-smoke.sh          # (root: it adds a throwaway user and an sshd)
#
# Steps: install Debian's openssh-server (and rsync, which `ray up` syncs with) if missing;
# a throwaway user (so `ray stop`, which kills every Ray process its user may kill, cannot touch
# anyone else's Ray) with a throwaway ed25519 key; sshd on 127.0.0.1 on a free port; render
# configs/cluster-local.yaml for head 127.0.0.1 (scripts/cluster_smoke_config.py: free ports, roles by
# custom resources on the one node, model tiny); `ray up -y`; wait for the router on the head;
# `raypd status`; Prometheus (Debian) on Ray's own scrape config and service-discovery file,
# one query per actor role; `raypd submit` of 20 requests of the shared Mooncake trace (read in
# place); check the report; `raypd trace-request` of one of them; `ray down -y`; check nothing
# of the run is left. Everything it starts it stops (also on failure, from the EXIT trap); it
# talks only to 127.0.0.1.
#
# Env: RAYPD_SMOKE_KEEP=1 keeps the work folder (logs, report) after the run;
# RAYPD_SMOKE_OUT=DIR copies report.json, the logs and the timings there.
# Exit codes: 0 ok, 1 a check failed, 77 cannot run here (not root, sshd not installable).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${RAYPD_SHARED_DIR:-$ROOT/../shared}"
TRACE="$SHARED/traces/mooncake_synthetic_trace.jsonl"
REQUESTS=20
T0=$(date +%s)
say() { echo "cluster-smoke: $*" >&2; }
skip() { say "SKIP: $*"; echo "cluster-smoke: skipped ($*)"; exit 77; }
fail() { say "FAIL: $*"; FAILED=1; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root (adds a throwaway user and runs sshd)"
[ -f "$TRACE" ] || fail "trace not found: $TRACE"
missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (Debian)"
  export DEBIAN_FRONTEND=noninteractive
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}") >&2 \
    || true
fi
[ -x /usr/sbin/sshd ] || skip "openssh-server could not be installed"
command -v rsync >/dev/null 2>&1 || skip "rsync could not be installed"

source "$ROOT/scripts/setup.sh"          # the driver's venv: ray, raypd
PY="$ROOT/.venv/bin/python"
WORK="$(mktemp -d /tmp/rpsmoke.XXXXXX)"
chmod 755 "$WORK"
SMOKE_USER="rpsmoke$$"
CLUSTER="raypd-smoke-$$"
SSHD_PID=""; PROM_PID=""; FAILED=0; UP_DONE=0
SSH_CTL_BEFORE="$(ls -d /tmp/ray_ssh_* 2>/dev/null || true)"

cleanup() {
  local rc=$?
  set +e
  if [ "$UP_DONE" = 1 ]; then
    say "cleanup: ray down"
    RAY_TMPDIR="$WORK/driver" TMPDIR="$WORK/driver" ray down -y "$WORK/cluster.yaml" >>"$WORK/ray-down.log" 2>&1
  fi
  [ -n "$PROM_PID" ] && kill "$PROM_PID" 2>/dev/null && wait "$PROM_PID" 2>/dev/null
  [ -n "$SSHD_PID" ] && kill "$SSHD_PID" 2>/dev/null && wait "$SSHD_PID" 2>/dev/null
  if id "$SMOKE_USER" >/dev/null 2>&1; then
    pkill -KILL -u "$SMOKE_USER" 2>/dev/null; sleep 1
    userdel "$SMOKE_USER" 2>/dev/null
  fi
  for d in $(ls -d /tmp/ray_ssh_* 2>/dev/null); do      # ssh control sockets of this run
    case "$SSH_CTL_BEFORE" in *"$d"*) ;; *) rm -rf "$d" ;; esac
  done
  if [ -n "${RAYPD_SMOKE_OUT:-}" ]; then
    mkdir -p "$RAYPD_SMOKE_OUT"
    cp "$WORK"/*.log "$WORK"/*.json "$WORK"/*.jsonl "$WORK/cluster.yaml" "$RAYPD_SMOKE_OUT"/ \
      2>/dev/null
    cp "$WORK/home/raypd-serve.log" "$RAYPD_SMOKE_OUT"/ 2>/dev/null   # the router, on the head
  fi
  if [ "${RAYPD_SMOKE_KEEP:-0}" = 1 ]; then say "kept $WORK"; else rm -rf "$WORK"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 1' INT TERM

lap() { echo "$(( $(date +%s) - T0 ))"; }
declare -A T

# ---- throwaway user, key and sshd ---------------------------------------------------------------
useradd -m -d "$WORK/home" -s /bin/bash "$SMOKE_USER"
usermod -p '*' "$SMOKE_USER"                        # no password, yet not "locked" for pubkey
install -d -m 700 -o "$SMOKE_USER" "$WORK/home/.ssh"
ssh-keygen -q -t ed25519 -N '' -C "raypd-smoke" -f "$WORK/id_ed25519"
ssh-keygen -q -t ed25519 -N '' -f "$WORK/host_key"
install -m 600 -o "$SMOKE_USER" "$WORK/id_ed25519.pub" "$WORK/home/.ssh/authorized_keys"
install -d -m 755 -o "$SMOKE_USER" "$WORK/rt" "$WORK/rt/tmp"   # the head's RAY_TMPDIR, TMPDIR
mkdir -p "$WORK/driver"                # the driver's (ray up's lock, state and config cache)

read -r P_SSH P_GCS P_METRICS P_ROUTER P_CLIENT P_DASH P_AGENT_HTTP P_AGENT_GRPC P_NM P_OM P_RTE \
  P_PROM P_WMIN < <("$PY" - <<'EOF'
import socket
socks, ports = [], []
def take(p: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        s.close()
        return False
    socks.append(s)
    return True
while len(ports) < 12:                 # one port each: the OS picks a free one
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p < 60000:
        socks.append(s); ports.append(p)
# then 41 consecutive worker ports, none of them one of the twelve (Ray refuses a port that
# two of its components name) and each free now
for base in range(20000, 60000 - 41, 41):
    if all(p not in ports for p in range(base, base + 41)) and \
            all(take(p) for p in range(base, base + 41)):
        break
else:
    raise SystemExit("cluster-smoke: no 41 consecutive free ports under 60000")
print(*ports, base)
EOF
)
P_WMAX=$((P_WMIN + 40))

mkdir -p /run/sshd
cat > "$WORK/sshd_config" <<EOF
ListenAddress 127.0.0.1:$P_SSH
HostKey $WORK/host_key
PidFile $WORK/sshd.pid
AllowUsers $SMOKE_USER
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UsePAM no
X11Forwarding no
MaxStartups 50:30:100
MaxSessions 50
EOF
/usr/sbin/sshd -D -f "$WORK/sshd_config" -E "$WORK/sshd.log" &
SSHD_PID=$!
PROXY="$PY $ROOT/scripts/ssh_loopback_proxy.py 127.0.0.1 $P_SSH"
ssh_user() {
  ssh -q -i "$WORK/id_ed25519" -o IdentitiesOnly=yes -o StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5 -o "ProxyCommand=$PROXY" \
    "$SMOKE_USER@127.0.0.1" "$@"
}
for _ in $(seq 50); do ssh_user true 2>/dev/null && break; sleep 0.2; done
ssh_user true || fail "sshd on 127.0.0.1:$P_SSH does not let $SMOKE_USER in (see $WORK/sshd.log)"
say "sshd on 127.0.0.1:$P_SSH, user $SMOKE_USER"

# The head's environment (Ray's launcher runs its commands in a login shell that reads ~/.bashrc):
# Ray's temp folder of its own, the cluster's address for `--address auto`, the machine's pip
# settings (package index, local wheels) for scripts/setup.sh, which uses the system python3.
{
  echo "export RAY_TMPDIR=$WORK/rt"
  echo "export TMPDIR=$WORK/rt/tmp"                   # torch's caches too, not in /tmp
  echo "export RAY_ADDRESS=127.0.0.1:$P_GCS"
  echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"   # Ray's one-node mode: it binds loopback only
  echo "export PYTHON=/usr/bin/python3"
  env | grep '^PIP_' | sed 's/^/export /; s/=\(.*\)$/="\1"/' || true
} > "$WORK/home/.bashrc"
if [ -f "$HOME/.config/pip/pip.conf" ]; then
  install -d -o "$SMOKE_USER" "$WORK/home/.config" "$WORK/home/.config/pip"
  install -m 644 -o "$SMOKE_USER" "$HOME/.config/pip/pip.conf" "$WORK/home/.config/pip/pip.conf"
fi
chown "$SMOKE_USER" "$WORK/home/.bashrc"

# ---- render the launcher config and bring the cluster up -----------------------------------------
PORTS=$(printf '{"gcs":%s,"metrics":%s,"router":%s,"client":%s,"dashboard":%s,"agent_http":%s,"agent_grpc":%s,"node_manager":%s,"object_manager":%s,"runtime_env":%s,"min_worker":%s,"max_worker":%s}' \
  "$P_GCS" "$P_METRICS" "$P_ROUTER" "$P_CLIENT" "$P_DASH" "$P_AGENT_HTTP" "$P_AGENT_GRPC" \
  "$P_NM" "$P_OM" "$P_RTE" "$P_WMIN" "$P_WMAX")
# The mounted folder is the repository's files as git sees them (tracked, or untracked and not
# ignored): `ray up` hashes every file under a mount before it syncs, and a checkout's .venv
# (1.4 GB) and .git cost it ~40 s here, though rsync never sends them.
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
   | rsync -a --from0 --ignore-missing-args --files-from=- ./ "$WORK/src/") || fail "could not stage the repository"
chmod -R a+rX "$WORK/src"
"$PY" "$ROOT/scripts/cluster_smoke_config.py" --template "$ROOT/configs/cluster-local.yaml" \
  --out "$WORK/cluster.yaml" --cluster-name "$CLUSTER" --user "$SMOKE_USER" \
  --key "$WORK/id_ed25519" --proxy-command "$PROXY" --repo-root "$WORK/src" --ports "$PORTS"

cd "$ROOT"
say "ray up (log $WORK/ray-up.log)"
t=$(date +%s)
UP_DONE=1
RAY_TMPDIR="$WORK/driver" TMPDIR="$WORK/driver" ray up -y --no-config-cache "$WORK/cluster.yaml" >"$WORK/ray-up.log" 2>&1 \
  || { tail -30 "$WORK/ray-up.log" >&2; fail "ray up failed"; }
T[ray_up]=$(( $(date +%s) - t ))

URL="http://127.0.0.1:$P_ROUTER"
t=$(date +%s)
until curl -fsS "$URL/health" >/dev/null 2>&1; do
  if [ $(( $(date +%s) - t )) -gt 300 ]; then
    ssh_user 'tail -40 ~/raypd-serve.log' >&2 || true
    fail "the router on the head did not answer $URL/health within 300 s"
  fi
  sleep 2
done
T[router_ready]=$(( $(date +%s) - t ))
say "router up at $URL"

raypd status --url "$URL" | tee "$WORK/status.log" >&2 || fail "raypd status failed"
raypd status --url "$URL" --json > "$WORK/status.json" || fail "raypd status --json failed"

# ---- Prometheus on Ray's own scrape config (as `ray metrics launch-prometheus` does) -----------
PROM_CFG="$(ls "$WORK"/rt/ray/session_latest/metrics/prometheus/prometheus.yml 2>/dev/null || true)"
[ -n "$PROM_CFG" ] || fail "Ray wrote no prometheus.yml under $WORK/rt/ray/session_latest"
sed 's/scrape_interval: 10s/scrape_interval: 2s/' "$PROM_CFG" > "$WORK/prometheus.yml"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/prom-data" \
  --web.listen-address="127.0.0.1:$P_PROM" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!

# ---- 20 requests of the shared trace, then the report ------------------------------------------
t=$(date +%s)
raypd submit "$TRACE" --limit "$REQUESTS" --url "$URL" --max-output-tokens 16 --vocab-size 250 --concurrency 4 \
  --no-progress --out "$WORK/report.json" --outputs "$WORK/outputs.jsonl" \
  --perfetto "$WORK/perfetto.json" >"$WORK/submit.log" 2>&1 \
  || { cat "$WORK/submit.log" >&2; fail "raypd submit failed"; }
T[submit]=$(( $(date +%s) - t ))
cat "$WORK/submit.log" >&2
OK=$("$PY" "$ROOT/scripts/cluster_smoke_checks.py" report "$WORK/report.json" --requests "$REQUESTS") \
  || fail "the report does not hold: $OK"
RID=$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["request_id"])' \
  "$WORK/outputs.jsonl")
raypd trace-request "$RID" --url "$URL" | tee "$WORK/trace-request.log" >&2 \
  || fail "raypd trace-request $RID failed"

t=$(date +%s)
"$PY" "$ROOT/scripts/cluster_smoke_checks.py" prometheus --url "http://127.0.0.1:$P_PROM" \
  --status "$WORK/status.json" --timeout 90 > "$WORK/prometheus-check.json" \
  || { cat "$WORK/prometheus-check.json" >&2; fail "Prometheus does not see every worker"; }
T[prometheus]=$(( $(date +%s) - t ))
cat "$WORK/prometheus-check.json" >&2
kill "$PROM_PID"; wait "$PROM_PID" 2>/dev/null || true; PROM_PID=""

# ---- down, and nothing left ----------------------------------------------------------------------
NODES=$("$PY" -c 'import json,sys; print(len({w.get("node_id") for w in json.load(open(sys.argv[1]))["actors"]}))' "$WORK/status.json")
t=$(date +%s)
RAY_TMPDIR="$WORK/driver" TMPDIR="$WORK/driver" ray down -y "$WORK/cluster.yaml" >"$WORK/ray-down.log" 2>&1 \
  || { tail -30 "$WORK/ray-down.log" >&2; fail "ray down failed"; }
UP_DONE=0
T[ray_down]=$(( $(date +%s) - t ))
left=""
for _ in $(seq 30); do
  left="$(pgrep -a -u "$SMOKE_USER" || true)"
  [ -z "$left" ] && break
  sleep 1
done
[ -z "$left" ] || { tail -5 "$WORK/home/raypd-serve.log" >&2; fail "still running after ray down: $left"; }
for p in "$P_GCS" "$P_ROUTER" "$P_METRICS" "$P_DASH"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then fail "port $p still answers after ray down"; fi
done
kill "$SSHD_PID"; wait "$SSHD_PID" 2>/dev/null || true; SSHD_PID=""
# files of this run outside $WORK (uids are reused: only those made since it started)
stray="$(find /tmp -maxdepth 1 -user "$SMOKE_USER" -newer "$WORK/sshd_config" 2>/dev/null || true)"
[ -z "$stray" ] || fail "the run left files in /tmp: $stray"

TOTAL=$(lap)
printf '{"ray_up_s": %s, "router_ready_s": %s, "submit_s": %s, "prometheus_s": %s, "ray_down_s": %s, "total_s": %s, "nodes": %s, "requests_ok": %s, "requests": %s, "model": "tiny"}\n' \
  "${T[ray_up]}" "${T[router_ready]}" "${T[submit]}" "${T[prometheus]}" "${T[ray_down]}" \
  "$TOTAL" "$NODES" "$OK" "$REQUESTS" > "$WORK/timings.json"
cat "$WORK/timings.json" >&2
echo "cluster-smoke: ok nodes=$NODES requests_ok=$OK/$REQUESTS seconds=$TOTAL (ray up ${T[ray_up]}s, router ${T[router_ready]}s, submit ${T[submit]}s, ray down ${T[ray_down]}s)"
