//! Lookup tables in memory the kernel may back with transparent huge pages.
//!
//! A large table read at random (jarh's slot table is 20 MiB at 1024 fingers x 1000 services)
//! costs a TLB miss per lookup on 4 KiB pages: measured 8.5 ns per jarh lookup with this VM's
//! `transparent_hugepage=madvise` against 6.0 ns with `always` (BENCHMARKS.md). A table of at
//! least [`HUGE_MIN`] bytes is therefore copied, once built, into an anonymous mapping advised
//! `MADV_HUGEPAGE` (memmap2's safe `advise`; the crate forbids `unsafe`), so it gets huge pages
//! wherever THP is `always` or `madvise`. Smaller tables, or any failure to map (then nothing
//! changes but the page size), stay in a `Vec`.

use memmap2::{Advice, MmapMut, MmapOptions};

/// Smallest table worth a mapping of its own: one huge page.
pub(crate) const HUGE_MIN: usize = 2 << 20;

/// A fixed-size word that can be stored as native-endian bytes.
pub(crate) trait Word: Copy {
    const SIZE: usize;
    fn read(bytes: &[u8]) -> Option<Self>;
    fn write(self, out: &mut [u8]);
}

macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            #[inline]
            fn read(bytes: &[u8]) -> Option<$t> {
                bytes.try_into().ok().map(<$t>::from_ne_bytes)
            }
            #[inline]
            fn write(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_ne_bytes());
            }
        }
    };
}
word!(u16);
word!(u32);
word!(u64);

/// An immutable table of words, in a `Vec` or in a huge-page-advised mapping.
pub(crate) enum Words<W> {
    Heap(Vec<W>),
    Huge { map: MmapMut, len: usize },
}

impl<W: Word> Words<W> {
    /// Move `v` into a huge-page-advised mapping when it is at least [`HUGE_MIN`] bytes.
    pub(crate) fn new(v: Vec<W>) -> Words<W> {
        let bytes = v.len().saturating_mul(W::SIZE);
        if bytes < HUGE_MIN {
            return Words::Heap(v);
        }
        let Ok(mut map) = MmapOptions::new().len(bytes).map_anon() else {
            return Words::Heap(v);
        };
        // Advice first, so the pages are faulted in as huge pages by the copy below. A kernel
        // without THP refuses the advice: the table then simply lives on small pages.
        let _ = map.advise(Advice::HugePage);
        for (w, out) in v.iter().zip(map.chunks_exact_mut(W::SIZE)) {
            w.write(out);
        }
        Words::Huge { map, len: v.len() }
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<W> {
        match self {
            Words::Heap(v) => v.get(i).copied(),
            Words::Huge { map, .. } => {
                // A wrapped range is empty or reversed, and `get` refuses it.
                let at = i.wrapping_mul(W::SIZE);
                W::read(map.get(at..at.wrapping_add(W::SIZE))?)
            }
        }
    }

    /// Words `i` and `i + 1`, with one bounds check.
    #[inline]
    pub(crate) fn get2(&self, i: usize) -> Option<(W, W)> {
        match self {
            Words::Heap(v) => match v.get(i..i.wrapping_add(2))? {
                [a, b] => Some((*a, *b)),
                _ => None,
            },
            Words::Huge { map, .. } => {
                let at = i.wrapping_mul(W::SIZE);
                let b = map.get(at..at.wrapping_add(2 * W::SIZE))?;
                let (x, y) = b.split_at(W::SIZE);
                Some((W::read(x)?, W::read(y)?))
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Words::Heap(v) => v.len(),
            Words::Huge { len, .. } => *len,
        }
    }

    pub(crate) fn to_vec(&self) -> Vec<W> {
        (0..self.len()).filter_map(|i| self.get(i)).collect()
    }
}

impl<W: Word> Clone for Words<W> {
    fn clone(&self) -> Words<W> {
        Words::new(self.to_vec())
    }
}

impl<W: Word> std::fmt::Debug for Words<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Words::Heap(_) => "heap",
            Words::Huge { .. } => "huge",
        };
        write!(f, "Words({kind}, {} words)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_tables_stay_on_the_heap_and_large_ones_read_back_exactly() {
        let small: Vec<u32> = (0..1000).collect();
        let w = Words::new(small.clone());
        assert!(matches!(w, Words::Heap(_)));
        assert_eq!(w.to_vec(), small);
        let n = HUGE_MIN / 4 + 7;
        let large: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let w = Words::new(large.clone());
        assert!(matches!(w, Words::Huge { .. }));
        assert_eq!(w.len(), n);
        assert_eq!(w.get(n), None);
        assert_eq!(w.get(usize::MAX), None);
        for i in [0, 1, n / 2, n - 1] {
            assert_eq!(w.get(i), large.get(i).copied());
        }
        assert_eq!(w.get2(n - 2), Some((large[n - 2], large[n - 1])));
        assert_eq!(w.get2(n - 1), None);
        assert_eq!(w.get2(usize::MAX), None);
        let h = Words::new(small.clone());
        assert_eq!(h.get2(998), Some((998, 999)));
        assert_eq!(h.get2(999), None);
        assert_eq!(w.clone().to_vec(), large);
        let wide: Vec<u64> = (0..(HUGE_MIN / 8) as u64 + 1)
            .map(|i| i << 33 | i)
            .collect();
        assert_eq!(Words::new(wide.clone()).to_vec(), wide);
    }
}
