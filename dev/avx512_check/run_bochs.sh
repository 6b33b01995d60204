#!/usr/bin/env bash
# Runs check.cpp's AVX-512 vs AVX2 block-product comparison on an emulated AVX-512 CPU (Bochs's
# Skylake-X model) on a machine without AVX-512: builds check.cpp static, makes it the init of
# an initramfs, boots Debian's kernel from an isolinux ISO in Bochs, and prints the guest's
# serial output (the verdict line: "AVX512 CHECK PASS: N cases, 0 mismatches").
#
# Needs (Debian): bochs bochsbios vgabios bochs-term isolinux syslinux-common genisoimage cpio,
# and a kernel image: apt-get download linux-image-6.1.0-<n>-amd64; dpkg -x it; KERNEL=<vmlinuz>.
# Takes ~10-20 minutes on a 2-core Zen 3 VM (booting the kernel dominates). Notes: README.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${WORK:-/tmp/avx512_bochs}
: "${KERNEL:?set KERNEL to a bzImage / vmlinuz (see the header)}"
mkdir -p "$work" && cd "$work"
rm -rf initrd iso && mkdir -p initrd/dev iso/isolinux

torch_inc=$(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
# shellcheck disable=SC2086
g++ -static -O2 -std=c++17 -mavx2 -mfma -mf16c -I"$root/csrc" $torch_inc \
  "$here/check.cpp" "$root/csrc/attention/cpu/avx512_block_products.cpp" -o initrd/init
mknod initrd/dev/console c 5 1
(cd initrd && find . | cpio -o -H newc --quiet > ../iso/initrd.img)
cp "$KERNEL" iso/vmlinuz
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 iso/isolinux/
# clearcpuid=321,323 (XSAVEC, XSAVES): Bochs 2.7's Skylake-X reports the standard-format XSAVE
# size for the compacted format too; Linux 6.1 then finds the sizes inconsistent and turns AVX
# and AVX-512 off. Without them the kernel uses the standard format, whose sizes agree.
cat > iso/isolinux/isolinux.cfg <<'CFG'
serial 0 115200
default check
prompt 0
timeout 0
label check
  kernel /vmlinuz
  append initrd=/initrd.img console=ttyS0,115200 loglevel=3 panic=-1 rdinit=/init nokaslr mitigations=off clearcpuid=321,323
CFG
# -R: Rock Ridge names (plain ISO 9660 would truncate them to 8.3 and isolinux finds no initrd)
mkisofs -quiet -R -J -o boot.iso -b isolinux/isolinux.bin -c isolinux/boot.cat -no-emul-boot \
  -boot-load-size 4 -boot-info-table iso

cat > bochsrc <<'CFG'
cpu: model=corei7_skylake_x, ips=200000000
memory: guest=512, host=512
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/bochs/VGABIOS-lgpl-latest
ata0-master: type=cdrom, path=boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=serial.txt
display_library: term
log: bochs.log
panic: action=fatal
info: action=ignore
clock: sync=none
CFG
rm -f serial.txt
# Debian's bochs is built with its debugger, which stops at the first instruction: feed it "c".
# The term display needs a terminal: script provides one. The guest powers off after the verdict.
TERM=xterm timeout "${TIMEOUT:-2400}" script -qfc "bochs -q -f bochsrc" /dev/null \
  < <(echo c; sleep "${TIMEOUT:-2400}") > bochs.out 2>&1 || true
cat serial.txt
grep -q "AVX512 CHECK PASS" serial.txt
