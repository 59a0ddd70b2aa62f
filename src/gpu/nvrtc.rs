//! NVRTC, called through Perseus's own handle to the file [`probe`] chose (as
//! [`crate::gpu::nccl`] does for NCCL). cudarc's NVRTC bindings find the library by a
//! search of their own, which tries the unversioned `libnvrtc.so` first; where the
//! loader finds another file under that name (an older toolkit's), their calls would go
//! there. Here every call goes to the file that `perseusrun --check-build` reports.
//!
//! Every failure is a [`PerseusError::GpuUnavailable`]: NVRTC missing, a function it
//! lacks, or a source it does not compile for the architecture asked for. None is an
//! argument error of the caller's.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use libloading::Library;

use crate::error::{PerseusError, Result};
use crate::gpu::libs::{probe, CudaLib};

type Program = *mut c_void;
type CreateProgram = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type GetSize = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetBytes = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyProgram = unsafe extern "C" fn(*mut Program) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type GetNumSupportedArchs = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetSupportedArchs = unsafe extern "C" fn(*mut c_int) -> c_int;

/// What NVRTC compiles a source to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A CUBIN for the real architecture `sm_N` (90 for an H100): the device loads it
    /// as it is.
    Cubin(u32),
    /// PTX for the virtual architecture `compute_N`: the driver compiles it for the
    /// device when it is loaded (a device of architecture N or later, a driver at least
    /// as new as NVRTC).
    Ptx(u32),
}

impl Target {
    /// NVRTC's option naming the architecture.
    fn option(self) -> String {
        match self {
            Target::Cubin(sm) => format!("--gpu-architecture=sm_{sm}"),
            Target::Ptx(sm) => format!("--gpu-architecture=compute_{sm}"),
        }
    }

    /// `sm_90` or `compute_90`.
    pub fn name(self) -> String {
        match self {
            Target::Cubin(sm) => format!("sm_{sm}"),
            Target::Ptx(sm) => format!("compute_{sm}"),
        }
    }
}

/// What to compile for a device of architecture `sm`, given the architectures this
/// NVRTC supports (`None` where it cannot say): a CUBIN of the device's own
/// architecture where NVRTC has it, else PTX for the newest supported architecture not
/// above the device's (which the device runs; its driver compiles the PTX when loading
/// it). `None` when every supported architecture is newer than the device.
pub fn target_for(sm: u32, supported: Option<&[u32]>) -> Option<Target> {
    let Some(supported) = supported else {
        return Some(Target::Cubin(sm));
    };
    if supported.contains(&sm) {
        return Some(Target::Cubin(sm));
    }
    supported
        .iter()
        .copied()
        .filter(|&s| s <= sm)
        .max()
        .map(Target::Ptx)
}

/// The NVRTC functions Perseus calls.
pub struct Nvrtc {
    _lib: Library,
    create: CreateProgram,
    compile: CompileProgram,
    log_size: GetSize,
    log: GetBytes,
    cubin_size: GetSize,
    cubin: GetBytes,
    ptx_size: GetSize,
    ptx: GetBytes,
    destroy: DestroyProgram,
    error_string: GetErrorString,
    /// `nvrtcGetNumSupportedArchs` and `nvrtcGetSupportedArchs` (NVRTC 11.2 and later).
    archs: Option<(GetNumSupportedArchs, GetSupportedArchs)>,
    /// The file it was loaded from.
    pub path: PathBuf,
    /// Its version ("13.2").
    pub version: String,
}

/// The NVRTC loaded so far (its functions are resolved once).
static LOADED: Mutex<Option<Arc<Nvrtc>>> = Mutex::new(None);

impl Nvrtc {
    /// NVRTC, found by [`probe`] (searching `dirs` first) and loaded once. A missing
    /// library, or one that lacks a function, is [`PerseusError::GpuUnavailable`] naming
    /// where it was looked for.
    pub fn get(dirs: &[PathBuf]) -> Result<Arc<Nvrtc>> {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = &*loaded {
            return Ok(n.clone());
        }
        let n = Arc::new(Self::load(dirs)?);
        *loaded = Some(n.clone());
        Ok(n)
    }

    fn load(dirs: &[PathBuf]) -> Result<Nvrtc> {
        let p = probe(CudaLib::Nvrtc, dirs);
        let Some(found) = p.loaded else {
            return Err(PerseusError::GpuUnavailable(p.missing_message()));
        };
        let missing = |e: libloading::Error| {
            PerseusError::GpuUnavailable(format!(
                "NVRTC {} at {} lacks a function Perseus needs: {e}",
                found.version,
                found.path.display()
            ))
        };
        // SAFETY: the library is already loaded (by `probe`), so this only takes another
        // reference to that file; each symbol is read with the signature nvrtc.h
        // declares for it.
        unsafe {
            let lib = Library::new(&found.path).map_err(missing)?;
            let archs = match (
                lib.get::<GetNumSupportedArchs>(b"nvrtcGetNumSupportedArchs\0"),
                lib.get::<GetSupportedArchs>(b"nvrtcGetSupportedArchs\0"),
            ) {
                (Ok(n), Ok(a)) => Some((*n, *a)),
                _ => None,
            };
            Ok(Nvrtc {
                create: *lib
                    .get::<CreateProgram>(b"nvrtcCreateProgram\0")
                    .map_err(missing)?,
                compile: *lib
                    .get::<CompileProgram>(b"nvrtcCompileProgram\0")
                    .map_err(missing)?,
                log_size: *lib
                    .get::<GetSize>(b"nvrtcGetProgramLogSize\0")
                    .map_err(missing)?,
                log: *lib
                    .get::<GetBytes>(b"nvrtcGetProgramLog\0")
                    .map_err(missing)?,
                cubin_size: *lib
                    .get::<GetSize>(b"nvrtcGetCUBINSize\0")
                    .map_err(missing)?,
                cubin: *lib.get::<GetBytes>(b"nvrtcGetCUBIN\0").map_err(missing)?,
                ptx_size: *lib.get::<GetSize>(b"nvrtcGetPTXSize\0").map_err(missing)?,
                ptx: *lib.get::<GetBytes>(b"nvrtcGetPTX\0").map_err(missing)?,
                destroy: *lib
                    .get::<DestroyProgram>(b"nvrtcDestroyProgram\0")
                    .map_err(missing)?,
                error_string: *lib
                    .get::<GetErrorString>(b"nvrtcGetErrorString\0")
                    .map_err(missing)?,
                archs,
                _lib: lib,
                path: found.path,
                version: found.version,
            })
        }
    }

    /// NVRTC's words for a result code.
    fn explain(&self, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let s = unsafe { (self.error_string)(code) };
        if s.is_null() {
            return format!("NVRTC error {code}");
        }
        // SAFETY: as above, NUL-terminated.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }

    /// An error naming this NVRTC and `what` failed.
    fn fail(&self, what: String) -> PerseusError {
        PerseusError::GpuUnavailable(format!(
            "NVRTC {} ({}): {what}",
            self.version,
            self.path.display()
        ))
    }

    fn check(&self, call: &str, code: c_int) -> Result<()> {
        match code {
            0 => Ok(()),
            code => Err(self.fail(format!("{call} failed: {}", self.explain(code)))),
        }
    }

    /// The real architectures this NVRTC compiles for (75, 80, ...), ascending; `None`
    /// where it cannot say (older than NVRTC 11.2).
    pub fn supported_archs(&self) -> Result<Option<Vec<u32>>> {
        let Some((count, list)) = self.archs else {
            return Ok(None);
        };
        let mut n: c_int = 0;
        // SAFETY: each call writes the integers it is given room for.
        unsafe {
            self.check("nvrtcGetNumSupportedArchs", count(&mut n))?;
            let mut archs = vec![0 as c_int; n.max(0) as usize];
            self.check("nvrtcGetSupportedArchs", list(archs.as_mut_ptr()))?;
            let mut archs: Vec<u32> = archs.into_iter().map(|a| a.max(0) as u32).collect();
            archs.sort_unstable();
            Ok(Some(archs))
        }
    }

    /// Compiles `src` (named `name` in messages) for `target`. Returns a CUBIN, or PTX
    /// with its terminating NUL (as `cuModuleLoadData` takes it). A source that does not
    /// compile is an error with NVRTC's log.
    pub fn compile(&self, name: &str, src: &str, target: Target) -> Result<Vec<u8>> {
        let src = CString::new(src)
            .map_err(|_| self.fail(format!("kernel source {name} holds a NUL")))?;
        let file = CString::new(format!("{name}.cu")).expect("kernel names hold no NUL");
        let option = CString::new(target.option()).expect("no NUL");
        let options = [option.as_ptr()];
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: the strings outlive the calls; `prog` is created here, used by this
        // thread alone and destroyed once below; each buffer has the size NVRTC reports.
        unsafe {
            let created = (self.create)(
                &mut prog,
                src.as_ptr(),
                file.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            self.check("nvrtcCreateProgram", created)?;
            let out = self.compiled(prog, name, target, &options);
            (self.destroy)(&mut prog);
            out
        }
    }

    /// The output of program `prog` once compiled with `options`, or the log of why not.
    ///
    /// # Safety
    /// `prog` must be a live program of this NVRTC.
    unsafe fn compiled(
        &self,
        prog: Program,
        name: &str,
        target: Target,
        options: &[*const c_char],
    ) -> Result<Vec<u8>> {
        let code = (self.compile)(prog, options.len() as c_int, options.as_ptr());
        if code != 0 {
            return Err(self.fail(format!(
                "kernel source {name} does not compile for {}: {}: {}",
                target.name(),
                self.explain(code),
                self.program_log(prog)
            )));
        }
        let (size, get, call) = match target {
            Target::Cubin(_) => (self.cubin_size, self.cubin, "nvrtcGetCUBIN"),
            Target::Ptx(_) => (self.ptx_size, self.ptx, "nvrtcGetPTX"),
        };
        let mut n = 0usize;
        self.check(call, size(prog, &mut n))?;
        let mut out = vec![0u8; n];
        self.check(call, get(prog, out.as_mut_ptr().cast()))?;
        Ok(out)
    }

    /// The compiler's log of `prog`, trimmed ("" where there is none).
    ///
    /// # Safety
    /// `prog` must be a live program of this NVRTC.
    unsafe fn program_log(&self, prog: Program) -> String {
        let mut n = 0usize;
        if (self.log_size)(prog, &mut n) != 0 || n == 0 {
            return String::new();
        }
        let mut log = vec![0u8; n];
        if (self.log)(prog, log.as_mut_ptr().cast()) != 0 {
            return String::new();
        }
        String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_gets_its_own_cubin_or_the_newest_ptx_it_runs() {
        let nvrtc13 = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(target_for(90, Some(&nvrtc13)), Some(Target::Cubin(90)));
        assert_eq!(target_for(75, Some(&nvrtc13)), Some(Target::Cubin(75)));
        // A device newer than this NVRTC knows: PTX it can run, compiled by its driver.
        let nvrtc12_4 = [50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90];
        assert_eq!(target_for(100, Some(&nvrtc12_4)), Some(Target::Ptx(90)));
        assert_eq!(target_for(120, Some(&nvrtc12_4)), Some(Target::Ptx(90)));
        // A gap in the list: the newest architecture below the device's.
        assert_eq!(target_for(85, Some(&nvrtc13)), Some(Target::Ptx(80)));
        // Every architecture NVRTC has is newer than the device: none.
        assert_eq!(target_for(70, Some(&nvrtc13)), None);
        assert_eq!(target_for(70, Some(&[])), None);
        // NVRTC cannot say: the device's own.
        assert_eq!(target_for(90, None), Some(Target::Cubin(90)));
        assert_eq!(
            Target::Ptx(90).option(),
            "--gpu-architecture=compute_90".to_string()
        );
        assert_eq!(Target::Cubin(80).name(), "sm_80");
    }
}
