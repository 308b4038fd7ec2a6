#!/usr/bin/env bash
# Build the Debian package with `cargo deb` (metadata: Cargo.toml, [package.metadata.deb]) and
# check it: the package's fields, the files it installs, the unit against systemd-analyze
# where that is installed, and the packaged binary's --version from a scratch root.
# Installs cargo-deb first when it is missing (`cargo install --locked`: the versions its
# lock file pins; once per machine, since cargo keeps it in ~/.cargo/bin).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo-deb >/dev/null 2>&1; then
  cargo install cargo-deb --locked
fi

# cargo deb prints the package's path last on stdout (its build log goes to stderr).
deb=$(cargo deb | tail -n 1)
[ -f "$deb" ] || { echo "check-deb: cargo deb printed no package path" >&2; exit 1; }

info=$(dpkg-deb -I "$deb")
echo "$info"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
for field in "Package: fulcrum" "Version: $version" "Section: net" "Architecture: "; do
  grep -q "^ *$field" <<<"$info" || { echo "check-deb: no '$field' in dpkg-deb -I" >&2; exit 1; }
done

contents=$(dpkg-deb -c "$deb")
echo "$contents"
for path in ./usr/bin/fulcrum ./usr/lib/systemd/system/fulcrum.service ./etc/fulcrum/fulcrum.yaml \
  ./usr/share/doc/fulcrum/README.md; do
  grep -qE " $path\$" <<<"$contents" || { echo "check-deb: $path not in the package" >&2; exit 1; }
done
dpkg-deb --ctrl-tarfile "$deb" | tar -tf - | grep -qx './conffiles' ||
  { echo "check-deb: no conffiles" >&2; exit 1; }
dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles | grep -qx '/etc/fulcrum/fulcrum.yaml' ||
  { echo "check-deb: /etc/fulcrum/fulcrum.yaml is not a conffile" >&2; exit 1; }

# Unpacked into a scratch root: the binary runs and validates the packaged config.
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
dpkg-deb -x "$deb" "$root"
"$root/usr/bin/fulcrum" --version
"$root/usr/bin/fulcrum" check "$root/etc/fulcrum/fulcrum.yaml"
if command -v systemd-analyze >/dev/null 2>&1; then
  # The unit as packaged, with /usr/bin/fulcrum pointing into the scratch root (verify checks
  # that the commands exist; its --root would look for the system's own targets there too).
  mkdir "$root/verify"
  sed "s|/usr/bin/fulcrum|$root/usr/bin/fulcrum|g" \
    "$(find "$root" -name fulcrum.service | head -n 1)" >"$root/verify/fulcrum.service"
  out=$(systemd-analyze verify "$root/verify/fulcrum.service" 2>&1) || true
  if [ -n "$out" ]; then
    echo "$out" >&2
    echo "check-deb: systemd-analyze verify complained" >&2
    exit 1
  fi
  echo "check-deb: systemd-analyze verify: unit ok"
else
  echo "check-deb: systemd-analyze not installed; unit not verified"
fi
echo "check-deb: $deb ok"
