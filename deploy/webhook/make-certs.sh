#!/usr/bin/env bash
# The injector's TLS without cert-manager (docs/webhook.md#without-cert-manager): a CA and a
# serving certificate for the injector's Service, made with openssl into DIR, then the two kubectl
# commands that put them in the cluster: the Secret the injector's Deployment mounts, and the
# webhook's caBundle, the CA the API server verifies the injector with.
#
#   deploy/webhook/make-certs.sh [--apply] [--namespace NAMESPACE] DIR
#
# Without --apply it prints the two commands; with --apply it runs them, with kubectl's current
# context (after `kubectl apply -k deploy/webhook/overlays/without-cert-manager`, which creates
# the namespace). --namespace: the namespace the injector was installed in (sidecar-system).
#
# DIR keeps the CA's key (ca.key): keep it private, or delete it and make a new CA (the caBundle
# then changes too). Run the script again with the same DIR before the serving certificate expires
# (SERVING_DAYS): it keeps the CA, so caBundle stays valid, and issues a new serving certificate,
# which the injector reads from the Secret once the kubelet has updated its files.
set -euo pipefail

CA_DAYS=3650
SERVING_DAYS=365
# The names of deploy/webhook/base: the Service the API server calls, the Secret the Deployment
# mounts, the MutatingWebhookConfiguration.
SERVICE=sidecar-injector
SECRET=sidecar-injector-tls
WEBHOOK=sidecar-injector

usage() {
    echo "usage: $0 [--apply] [--namespace NAMESPACE] DIR" >&2
    exit 2
}

apply=false
namespace=sidecar-system
while [ $# -gt 0 ]; do
    case $1 in
        --apply) apply=true; shift ;;
        --namespace) [ $# -ge 2 ] || usage; namespace=$2; shift 2 ;;
        --namespace=*) namespace=${1#*=}; shift ;;
        -h|--help) usage ;;
        -*) echo "make-certs: unknown option $1" >&2; usage ;;
        *) break ;;
    esac
done
[ $# -eq 1 ] || usage
dir=$1
command -v openssl >/dev/null || { echo "make-certs: openssl is not on PATH" >&2; exit 1; }

# The API server calls the Service as <service>.<namespace>.svc and verifies that name.
dns_names=("$SERVICE.$namespace.svc" "$SERVICE.$namespace.svc.cluster.local")
san=$(printf 'DNS:%s,' "${dns_names[@]}")

mkdir -p "$dir"
umask 077
config="$dir/openssl.cnf"
cat >"$config" <<EOF
[req]
distinguished_name = subject
prompt = no
[subject]
CN = $SERVICE-ca
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[serving]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = ${san%,}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF

new_key() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"
}

if [ -s "$dir/ca.key" ] && [ -s "$dir/ca.crt" ]; then
    echo "make-certs: keeping the CA in $dir (caBundle unchanged)" >&2
else
    new_key "$dir/ca.key"
    openssl req -x509 -new -key "$dir/ca.key" -sha256 -days "$CA_DAYS" -config "$config" \
        -extensions ca -out "$dir/ca.crt"
    echo "make-certs: made a CA in $dir, good for $CA_DAYS days" >&2
fi

new_key "$dir/tls.key"
openssl req -new -key "$dir/tls.key" -subj "/CN=${dns_names[0]}" -config "$config" \
    -out "$dir/tls.csr"
# OpenSSL 3 says "Certificate request self-signature ok" on stderr: shown only if it fails.
if ! signed=$(openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -sha256 -days "$SERVING_DAYS" -set_serial "0x$(openssl rand -hex 16)" \
        -extfile "$config" -extensions serving -out "$dir/tls.crt" 2>&1); then
    echo "$signed" >&2
    exit 1
fi
rm -f "$config" "$dir/tls.csr"
openssl verify -CAfile "$dir/ca.crt" "$dir/tls.crt" >/dev/null
echo "make-certs: a serving certificate for ${dns_names[*]} in $dir, good for $SERVING_DAYS days" >&2

ca_bundle=$(openssl base64 -A -in "$dir/ca.crt")
# both webhooks (the second for namespaces that enforce Pod Security) call the injector
ca_patch="[{\"op\": \"add\", \"path\": \"/webhooks/0/clientConfig/caBundle\", \"value\": \"$ca_bundle\"},"
ca_patch+=" {\"op\": \"add\", \"path\": \"/webhooks/1/clientConfig/caBundle\", \"value\": \"$ca_bundle\"}]"
if $apply; then
    # Created, or replaced: the same command renews it.
    kubectl --namespace "$namespace" create secret tls "$SECRET" --cert="$dir/tls.crt" \
        --key="$dir/tls.key" --dry-run=client --output=yaml | kubectl apply --filename=-
    kubectl patch mutatingwebhookconfiguration "$WEBHOOK" --type=json --patch="$ca_patch"
else
    echo "# The Secret the injector mounts (created, or replaced), then the webhook's caBundle:"
    echo "kubectl --namespace $namespace create secret tls $SECRET --cert=$(printf %q "$dir/tls.crt")" \
        "--key=$(printf %q "$dir/tls.key") --dry-run=client --output=yaml | kubectl apply --filename=-"
    echo "kubectl patch mutatingwebhookconfiguration $WEBHOOK --type=json --patch='$ca_patch'"
fi
