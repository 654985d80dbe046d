# Writes DST from SRC with the current git revision; leaves DST untouched when
# nothing changed, so an unchanged tree does not relink.
execute_process(COMMAND git rev-parse --short=12 HEAD
  WORKING_DIRECTORY ${ROOT} OUTPUT_VARIABLE TANDEM_GIT_REV
  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT TANDEM_GIT_REV)
  set(TANDEM_GIT_REV "unknown")
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no
    WORKING_DIRECTORY ${ROOT} OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(dirty)
    set(TANDEM_GIT_REV "${TANDEM_GIT_REV}-dirty")
  endif()
endif()
configure_file(${SRC} ${DST}.tmp @ONLY)
file(COPY_FILE ${DST}.tmp ${DST} ONLY_IF_DIFFERENT)
