//! A small eBPF assembler: instructions by name, jumps by label, map references by file
//! descriptor. PURE. Encoding: the kernel's instruction set document
//! (Documentation/bpf/standardization/instruction-set.rst, RFC 9669): 8 bytes per
//! instruction, opcode, destination and source registers, 16-bit offset, 32-bit immediate.

use std::collections::HashMap;

/// Register numbers: r0 (return value), r1-r5 (arguments, clobbered by calls), r6-r9 (kept
/// across calls), r10 (frame pointer, read-only).
pub(crate) type Reg = u8;

pub(crate) const R0: Reg = 0;
pub(crate) const R1: Reg = 1;
pub(crate) const R2: Reg = 2;
pub(crate) const R3: Reg = 3;
pub(crate) const R4: Reg = 4;
pub(crate) const R5: Reg = 5;
pub(crate) const R6: Reg = 6;
pub(crate) const R7: Reg = 7;
pub(crate) const R8: Reg = 8;
pub(crate) const R9: Reg = 9;
pub(crate) const FP: Reg = 10;

/// Memory access sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Size {
    B = 0x10,
    H = 0x08,
    W = 0x00,
    DW = 0x18,
}

/// Arithmetic operations (the high nibble of the opcode).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Alu {
    Add = 0x00,
    Mul = 0x20,
    Or = 0x40,
    And = 0x50,
    Lsh = 0x60,
    Rsh = 0x70,
    Xor = 0xa0,
    Mov = 0xb0,
}

/// Jump conditions (unsigned comparisons, 64-bit).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cond {
    Eq = 0x10,
    Gt = 0x20,
    Ne = 0x50,
    Lt = 0xa0,
}

const CLASS_LD: u8 = 0x00;
const CLASS_LDX: u8 = 0x01;
const CLASS_ST: u8 = 0x02;
const CLASS_STX: u8 = 0x03;
const CLASS_ALU: u8 = 0x04;
const CLASS_JMP: u8 = 0x05;
const CLASS_ALU64: u8 = 0x07;
const MODE_MEM: u8 = 0x60;
const MODE_IMM: u8 = 0x00;
const SRC_X: u8 = 0x08;
const OP_CALL: u8 = 0x80;
const OP_EXIT: u8 = 0x90;
/// `src` of an `LD_IMM64` whose immediate is a map's file descriptor.
const PSEUDO_MAP_FD: u8 = 1;

/// Why a program could not be assembled.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AsmError {
    /// A jump names a label never placed.
    #[error("jump to undefined label {0}")]
    UndefinedLabel(String),
    /// A label placed twice.
    #[error("label {0} placed twice")]
    DuplicateLabel(String),
    /// A jump too far for its 16-bit offset.
    #[error("jump to {0} out of range")]
    OutOfRange(String),
}

/// A program being written.
#[derive(Debug, Default)]
pub(crate) struct Asm {
    code: Vec<[u8; 8]>,
    labels: HashMap<String, usize>,
    jumps: Vec<(usize, String)>,
    duplicate: Option<String>,
}

fn insn(code: u8, dst: Reg, src: Reg, off: i16, imm: i32) -> [u8; 8] {
    let o = off.to_le_bytes();
    let i = imm.to_le_bytes();
    [code, (src << 4) | dst, o[0], o[1], i[0], i[1], i[2], i[3]]
}

impl Asm {
    fn push(&mut self, code: u8, dst: Reg, src: Reg, off: i16, imm: i32) {
        self.code.push(insn(code, dst, src, off, imm));
    }

    /// Place `name` at the next instruction.
    pub(crate) fn label(&mut self, name: impl Into<String>) {
        let name = name.into();
        if self.labels.insert(name.clone(), self.code.len()).is_some() {
            self.duplicate.get_or_insert(name);
        }
    }

    /// `dst op= imm`, 64-bit.
    pub(crate) fn alu64_imm(&mut self, op: Alu, dst: Reg, imm: i32) {
        self.push(CLASS_ALU64 | op as u8, dst, 0, 0, imm);
    }

    /// `dst op= src`, 64-bit.
    pub(crate) fn alu64(&mut self, op: Alu, dst: Reg, src: Reg) {
        self.push(CLASS_ALU64 | op as u8 | SRC_X, dst, src, 0, 0);
    }

    /// `dst op= imm`, 32-bit (the result zero-extended).
    pub(crate) fn alu32_imm(&mut self, op: Alu, dst: Reg, imm: i32) {
        self.push(CLASS_ALU | op as u8, dst, 0, 0, imm);
    }

    /// `dst op= src`, 32-bit (the result zero-extended).
    pub(crate) fn alu32(&mut self, op: Alu, dst: Reg, src: Reg) {
        self.push(CLASS_ALU | op as u8 | SRC_X, dst, src, 0, 0);
    }

    /// `dst = src`.
    pub(crate) fn mov(&mut self, dst: Reg, src: Reg) {
        self.alu64(Alu::Mov, dst, src);
    }

    /// `dst = imm` (sign-extended).
    pub(crate) fn mov_imm(&mut self, dst: Reg, imm: i32) {
        self.alu64_imm(Alu::Mov, dst, imm);
    }

    /// `dst = *(size *)(src + off)`.
    pub(crate) fn ldx(&mut self, size: Size, dst: Reg, src: Reg, off: i16) {
        self.push(CLASS_LDX | MODE_MEM | size as u8, dst, src, off, 0);
    }

    /// `*(size *)(dst + off) = src`.
    pub(crate) fn stx(&mut self, size: Size, dst: Reg, off: i16, src: Reg) {
        self.push(CLASS_STX | MODE_MEM | size as u8, dst, src, off, 0);
    }

    /// `*(size *)(dst + off) = imm`.
    pub(crate) fn st(&mut self, size: Size, dst: Reg, off: i16, imm: i32) {
        self.push(CLASS_ST | MODE_MEM | size as u8, dst, 0, off, imm);
    }

    /// `dst = map` (a 64-bit immediate: two instructions).
    pub(crate) fn ld_map(&mut self, dst: Reg, fd: i32) {
        self.push(
            CLASS_LD | MODE_IMM | Size::DW as u8,
            dst,
            PSEUDO_MAP_FD,
            0,
            fd,
        );
        self.push(0, 0, 0, 0, 0);
    }

    /// `if dst cond imm goto label`.
    pub(crate) fn jmp_imm(&mut self, cond: Cond, dst: Reg, imm: i32, label: &str) {
        self.jumps.push((self.code.len(), label.to_string()));
        self.push(CLASS_JMP | cond as u8, dst, 0, 0, imm);
    }

    /// `if dst cond src goto label`.
    pub(crate) fn jmp(&mut self, cond: Cond, dst: Reg, src: Reg, label: &str) {
        self.jumps.push((self.code.len(), label.to_string()));
        self.push(CLASS_JMP | cond as u8 | SRC_X, dst, src, 0, 0);
    }

    /// `goto label`.
    pub(crate) fn ja(&mut self, label: &str) {
        self.jumps.push((self.code.len(), label.to_string()));
        self.push(CLASS_JMP, 0, 0, 0, 0);
    }

    /// `call helper`.
    pub(crate) fn call(&mut self, helper: i32) {
        self.push(CLASS_JMP | OP_CALL, 0, 0, 0, helper);
    }

    /// `exit` (returns r0).
    pub(crate) fn exit(&mut self) {
        self.push(CLASS_JMP | OP_EXIT, 0, 0, 0, 0);
    }

    /// Instructions so far.
    pub(crate) fn len(&self) -> usize {
        self.code.len()
    }

    /// The program's bytes, every jump resolved.
    pub(crate) fn finish(mut self) -> Result<Vec<u8>, AsmError> {
        if let Some(name) = self.duplicate {
            return Err(AsmError::DuplicateLabel(name));
        }
        for (at, name) in &self.jumps {
            let target = *self
                .labels
                .get(name)
                .ok_or_else(|| AsmError::UndefinedLabel(name.clone()))?;
            let off = i16::try_from(target as i64 - *at as i64 - 1)
                .map_err(|_| AsmError::OutOfRange(name.clone()))?;
            self.code[*at][2..4].copy_from_slice(&off.to_le_bytes());
        }
        Ok(self.code.concat())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_resolve_forward_and_back() {
        let mut a = Asm::default();
        a.label("top");
        a.mov_imm(R0, 0);
        a.jmp_imm(Cond::Eq, R0, 1, "end");
        a.ja("top");
        a.label("end");
        a.exit();
        let p = a.finish().expect("assembles");
        let off = |i: usize| i16::from_le_bytes([p[i * 8 + 2], p[i * 8 + 3]]);
        assert_eq!(off(1), 1, "1 + 1 + 1 = 3");
        assert_eq!(off(2), -3, "2 + 1 - 3 = 0");
        assert_eq!(p[0..2], [0xb7, 0x00]);
        assert_eq!(p[3 * 8], 0x95);
    }

    #[test]
    fn bad_labels_are_errors() {
        let mut a = Asm::default();
        a.ja("nowhere");
        assert_eq!(a.finish(), Err(AsmError::UndefinedLabel("nowhere".into())));
        let mut a = Asm::default();
        a.label("x");
        a.label("x");
        assert_eq!(a.finish(), Err(AsmError::DuplicateLabel("x".into())));
    }

    #[test]
    fn registers_and_maps_encode_as_the_kernel_reads_them() {
        let mut a = Asm::default();
        a.ldx(Size::W, R2, R6, 76);
        a.stx(Size::DW, FP, -8, R0);
        a.ld_map(R1, 7);
        a.alu32_imm(Alu::Mul, R1, 0x85eb_ca6b_u32 as i32);
        let p = a.finish().expect("assembles");
        assert_eq!(p[0..4], [0x61, 0x62, 76, 0]);
        assert_eq!(p[8..12], [0x7b, 0x0a, 0xf8, 0xff]);
        assert_eq!(p[16..18], [0x18, 0x11]);
        assert_eq!(p[20..24], 7i32.to_le_bytes());
        assert_eq!(p[32..40], [0x24, 0x01, 0, 0, 0x6b, 0xca, 0xeb, 0x85]);
    }
}
