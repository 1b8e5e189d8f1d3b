#!/usr/bin/env bash
# Make a small PKI for kvstore's mTLS (docs/security.md, "TLS"): a CA, one server
# certificate and any number of client certificates, all signed by that CA.
#
#   scripts/make_certs.sh DIR [--host NAME]... [--client NAME]... [--days N]
#
# DIR/ca.pem, DIR/ca.key                  the CA (keep ca.key off the nodes)
# DIR/server.pem, DIR/server.key          SANs: 127.0.0.1, ::1, localhost, this host's
#                                         name and every --host; usable as a client
#                                         certificate too (a daemon pulling from peers)
# DIR/<client>.pem, DIR/<client>.key      one pair per --client (default: client)
#
# Keys are EC P-256. Every file is created 0600 (umask 077), whatever the caller's umask.
# Needs openssl (1.1.1 or later).
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
dir=$1; shift
hosts=(); clients=(); days=365
while [ $# -gt 0 ]; do
    case $1 in
        --host) hosts+=("$2"); shift 2 ;;
        --client) clients+=("$2"); shift 2 ;;
        --days) days=$2; shift 2 ;;
        *) usage ;;
    esac
done
[ ${#clients[@]} -gt 0 ] || clients=(client)
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }

umask 077
mkdir -p "$dir"
cd "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME CN EXTFILE: NAME.key + CSR -> NAME.pem signed by the CA
sign() {
    key "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$2" -out "$tmp/$1.csr"
    openssl x509 -req -in "$tmp/$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial \
        -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$3" -out "$1.pem" 2>/dev/null
}

if [ ! -f ca.pem ] || [ ! -f ca.key ]; then
    key ca.key
    openssl req -x509 -new -key ca.key -subj "/CN=kvstore CA" -days "$days" -sha256 \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem
fi

san="DNS:localhost,IP:127.0.0.1,IP:::1"
own=$(hostname 2>/dev/null || true)
[ -n "$own" ] && san+=",DNS:$own"
for h in "${hosts[@]}"; do
    if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
done
cat > "$tmp/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san
EXT
sign server "${own:-localhost}" "$tmp/server.ext"

cat > "$tmp/client.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EXT
for c in "${clients[@]}"; do
    sign "$c" "$c" "$tmp/client.ext"
done
chmod 600 ./*.pem ./*.key
echo "made in $dir: ca.pem server.pem server.key ${clients[*]/%/.pem}"
