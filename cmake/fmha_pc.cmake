# fmha_pc.cmake — run by `cmake --install` after the FMHA_* variables are set
# by CMakeLists.txt's install rules. Writes fmha.pc for this install's prefix
# (`cmake --install --prefix` may name another one than the configured
# CMAKE_INSTALL_PREFIX) and installs it into <libdir>/pkgconfig.
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${FMHA_${dir}}")
    set(FMHA_PC_${dir} "${FMHA_${dir}}")
  else()
    set(FMHA_PC_${dir} "\${prefix}/${FMHA_${dir}}")
  endif()
endforeach()
set(FMHA_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
configure_file("${FMHA_PC_TEMPLATE}" "${FMHA_PC_OUTPUT}" @ONLY)
if(IS_ABSOLUTE "${FMHA_LIBDIR}")
  set(pcdir "${FMHA_LIBDIR}/pkgconfig")
else()
  set(pcdir "${CMAKE_INSTALL_PREFIX}/${FMHA_LIBDIR}/pkgconfig")
endif()
file(INSTALL DESTINATION "${pcdir}" TYPE FILE FILES "${FMHA_PC_OUTPUT}")
